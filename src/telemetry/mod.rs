//! What the library reports about itself: the metric hooks of the hot paths, through the
//! `metrics` facade. Below every module that counts something, so that counting never ties
//! a module to the one that serves the figures.

pub(crate) mod metrics;
#[cfg(feature = "otel")]
pub(crate) mod otel;

/// The metadata keys of the W3C trace context an event carries.
pub(crate) const TRACE_KEYS: [&str; 2] = ["traceparent", "tracestate"];

/// Carries the trace to a follow-up event (`to`, its metadata) from the delivery that causes
/// it: with the feature `otel`, the delivery's own span becomes the follow-up's parent;
/// otherwise (or when that span is not traced) the delivery's `traceparent` / `tracestate` are
/// copied, so the trace id at least goes on. A follow-up that sets its own is left alone.
pub(crate) fn carry_trace(
    delivery_span: &tracing::Span,
    from: &serde_json::Value,
    to: &mut serde_json::Value,
) {
    if to.get(TRACE_KEYS[0]).is_some() {
        return;
    }
    #[cfg(feature = "otel")]
    otel::inject(delivery_span, to);
    #[cfg(not(feature = "otel"))]
    let _ = delivery_span;
    if to.get(TRACE_KEYS[0]).is_some() {
        return;
    }
    let Some(map) = to.as_object_mut() else {
        return;
    };
    for key in TRACE_KEYS {
        if let Some(v) = from.get(key) {
            map.insert(key.to_owned(), v.clone());
        }
    }
}

/// The fields every log line about one event carries (docs/operations.md, "Logs: following one event"), whatever the event's
/// source: an inbox row, an event a transport publishes or a receiving side records, a new
/// event. Each source has a `From` impl where it is defined, above this layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EventFields<'a> {
    /// The consumer, for a line about one consumer's delivery.
    pub consumer: Option<&'a str>,
    pub event_id: uuid::Uuid,
    pub event_type: &'a str,
    pub aggregate_id: &'a str,
    pub correlation_id: Option<&'a str>,
    pub causation_id: Option<&'a str>,
    /// This attempt, from 1, where there is one.
    pub attempt: Option<i64>,
}

/// Logs the event `$name` at `$level` with the [`EventFields`] of `$fields`, then any extra
/// fields in `tracing`'s syntax. The one place the field list is written out.
macro_rules! event {
    ($level:ident, $name:literal, $fields:expr $(, $($extra:tt)+)?) => {{
        let f: $crate::telemetry::EventFields<'_> = $fields;
        tracing::$level!(
            name: $name,
            consumer = f.consumer, event_id = %f.event_id, event_type = f.event_type,
            aggregate_id = f.aggregate_id,
            correlation_id = %$crate::telemetry::Correlation(f.correlation_id, f.event_id),
            causation_id = f.causation_id, attempt = f.attempt,
            $($($extra)+,)?
            $name
        )
    }};
}
pub(crate) use event;

/// The correlation id a line shows: the event's own, or, for an event that starts a chain and
/// has none yet (a new event before it is written), its id, which the insert makes its
/// correlation id.
pub(crate) struct Correlation<'a>(pub Option<&'a str>, pub uuid::Uuid);

impl std::fmt::Display for Correlation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(c) => f.write_str(c),
            None => write!(f, "{}", self.1),
        }
    }
}
