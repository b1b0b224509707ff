//! What the library reports about itself: the metric hooks of the hot paths, through the
//! `metrics` facade. Below every module that counts something, so that counting never ties
//! a module to the one that serves the figures.

pub(crate) mod metrics;
