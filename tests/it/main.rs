//! The integration tests, one crate (Cargo.toml: `autotests = false`, `[[test]] name = "it"`)
//! so the library and the dev-dependencies are linked once. Each module is a former
//! `tests/<name>.rs`; a test's full name is `<module>::<test>`, which is what the child-process
//! tests pass to `common::spawn_entry`.
//!
//! `tests/common/` stays outside this folder: the benchmark includes `tests/common/url.rs`.

#[path = "../common/mod.rs"]
mod common;

mod admin;
mod batch;
mod blocking;
#[cfg(feature = "cli")]
mod cli;

mod contracts;
mod core;
mod cursor;
mod effects;
mod embedding;
mod failure;
mod fanout;
mod harness;
mod hung;
mod isolation;
mod lanes;
mod lifecycle;
mod logs;
#[cfg(feature = "nats")]
mod nats;
mod network;
mod ops;
mod ordered;
#[cfg(feature = "otel")]
mod otel;
mod pipeline;
mod plan;
mod pooler;
mod reconcile;
mod redact;
mod replay;
mod server_crash;
mod stalls;
mod storage;
mod transport;
mod upgrade;
