//! OpenTelemetry across the outbox (feature `otel`): the producer's span context travels with
//! the event, as W3C `traceparent` / `tracestate` keys of its metadata (and as message headers
//! on NATS), and each delivery runs in a span whose parent is that context. An outbox hides the
//! link between the request and its consumers behind a table; this is what puts it back.
//!
//! The trace context is written and read here by hand, as the W3C format spells it, so that
//! the library needs the OpenTelemetry API only, not an SDK or a configured global propagator.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::EventFields;

const TRACEPARENT: &str = super::TRACE_KEYS[0];
const TRACESTATE: &str = super::TRACE_KEYS[1];

/// `span`'s W3C trace context, `(traceparent, tracestate)`, when it belongs to a valid
/// OpenTelemetry trace (an OpenTelemetry layer is installed and the span is enabled).
pub(crate) fn trace_context(span: &tracing::Span) -> Option<(String, String)> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    if !sc.is_valid() {
        return None;
    }
    let parent = format!(
        "00-{:032x}-{:016x}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    );
    Some((parent, sc.trace_state().header()))
}

/// `metadata` with `span`'s trace context written in (replacing one there), if the span has
/// one and the metadata is an object.
pub(crate) fn inject(span: &tracing::Span, metadata: &mut serde_json::Value) {
    let (Some((parent, state)), Some(map)) = (trace_context(span), metadata.as_object_mut()) else {
        return;
    };
    map.insert(TRACEPARENT.into(), parent.into());
    if state.is_empty() {
        map.remove(TRACESTATE);
    } else {
        map.insert(TRACESTATE.into(), state.into());
    }
}

/// What an event written now stores as its metadata: its own, plus the current span's trace
/// context when it carries none (a follow-up already carries its delivery's).
pub(crate) fn with_current(
    metadata: &serde_json::Value,
) -> std::borrow::Cow<'_, serde_json::Value> {
    if metadata.get(TRACEPARENT).is_some() {
        return std::borrow::Cow::Borrowed(metadata);
    }
    let mut owned = metadata.clone();
    inject(&tracing::Span::current(), &mut owned);
    std::borrow::Cow::Owned(owned)
}

/// The remote parent stored in `metadata`, if it holds a well-formed `traceparent`
/// (version 00: `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`).
pub(crate) fn extract(metadata: &serde_json::Value) -> Option<opentelemetry::Context> {
    let parent = metadata.get(TRACEPARENT)?.as_str()?;
    let mut parts = parent.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = metadata
        .get(TRACESTATE)
        .and_then(|s| s.as_str())
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let sc = SpanContext::new(trace_id, span_id, TraceFlags::new(flags), true, state);
    sc.is_valid()
        .then(|| opentelemetry::Context::new().with_remote_span_context(sc))
}

/// The span one delivery runs in: `outbox.deliver`, with the event's ids, child of the
/// producer's context when the event's metadata carries one.
pub(crate) fn delivery_span(f: EventFields<'_>, metadata: &serde_json::Value) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox.deliver",
        consumer = f.consumer,
        event_id = %f.event_id,
        event_type = f.event_type,
        aggregate_id = f.aggregate_id,
        correlation_id = %super::Correlation(f.correlation_id, f.event_id),
        causation_id = f.causation_id,
        attempt = f.attempt,
    );
    if let Some(parent) = extract(metadata) {
        // Fails only when no OpenTelemetry layer is installed: nothing to link then.
        let _ = span.set_parent(parent);
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_read_as_the_w3c_format_spells_it() {
        let good = serde_json::json!({
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "tracestate": "congo=t61rcWkgMzE",
        });
        let cx = extract(&good).expect("a valid parent");
        let sc = cx.span().span_context().clone();
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(
            format!("{:032x}", sc.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(format!("{:016x}", sc.span_id()), "00f067aa0ba902b7");
        assert_eq!(sc.trace_state().header(), "congo=t61rcWkgMzE");
        for bad in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "garbage",
        ] {
            assert!(
                extract(&serde_json::json!({ "traceparent": bad })).is_none(),
                "{bad}"
            );
        }
        assert!(extract(&serde_json::json!({})).is_none());
    }
}
