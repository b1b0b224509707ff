//! The operator API: an actix-web scope the application mounts.
