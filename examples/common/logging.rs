//! The examples' log output: JSON lines (tracing-subscriber's JSON formatter, one object per
//! line, the event's fields at the top level) when `LOG_FORMAT=json`, for a log pipeline to
//! parse; plain text otherwise. `RUST_LOG` filters as usual (default `info`). And how a
//! service's `run` ends the process.

pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if std::env::var("LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json")) {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

/// The process's exit: success, or the error logged as `what failed`.
pub fn exit<E: std::fmt::Display>(result: Result<(), E>, what: &str) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "{what} failed");
            std::process::ExitCode::FAILURE
        }
    }
}
