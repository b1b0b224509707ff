//! OpenTelemetry across the outbox (feature `otel`), against real PostgreSQL and an in-memory
//! span exporter: the producer's span is the parent of the delivery's span, across the outbox
//! table, and a follow-up event's delivery is the child of the delivery that caused it, all in
//! one trace.

use crate::common;

use actix::prelude::*;
use actix_outbox::{enqueue, ConsumerConfig, Delivery, HandlerError, NewEvent, OutboxRuntime};
use common::*;
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

/// Handles ORDER_STATUS_CHANGED by enqueueing a follow-up, ORDER_NOTIFIED.
struct Notifier;

impl Actor for Notifier {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Notifier {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async move {
            let follow_up = NewEvent::new(
                "ORDER_NOTIFIED",
                "order",
                d.aggregate_id(),
                serde_json::json!({}),
            );
            d.enqueue(follow_up).await?;
            Ok(())
        })
    }
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

fn delivery(spans: &[SpanData], consumer: &str) -> SpanData {
    let found: Vec<_> = spans
        .iter()
        .filter(|s| {
            s.name == "outbox.deliver" && attribute(s, "consumer").as_deref() == Some(consumer)
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one delivery span for {consumer}: {spans:#?}"
    );
    found[0].clone()
}

#[actix_rt::test]
async fn the_producers_span_is_the_parent_of_each_delivery_across_the_outbox_and_a_follow_up() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("info"))
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    // This thread's: the runtime's actors run on it.
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = TestDb::new().await;
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(consumer("notifier", 3), || Notifier)
        .consumer(
            ConsumerConfig::new("mailer").subscribe("ORDER_NOTIFIED"),
            || Recorder {
                name: "mailer".into(),
                behaviour: Behaviour::default(),
            },
        )
        .start()
        .await
        .expect("start runtime");

    // The request that causes it all.
    let request = tracing::info_span!("request");
    let conn = db.pool.get().await.unwrap();
    let id = enqueue(&conn, &order_event("o-1"))
        .instrument(request.clone())
        .await
        .unwrap();
    drop(conn);
    drop(request);
    let mailed = "SELECT count(*) AS n FROM effects WHERE consumer = 'mailer'";
    assert_eq!(db.wait_for(mailed, 1, WAIT).await, 1);
    db.finish(&[&rt]).await;
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();

    let request = spans
        .iter()
        .find(|s| s.name == "request")
        .expect("the request span");
    let trace = request.span_context.trace_id();
    assert_ne!(trace, TraceId::INVALID);
    // Across the outbox: the producer's span is the first delivery's parent.
    let first = delivery(&spans, "notifier");
    assert_eq!(first.span_context.trace_id(), trace);
    assert_eq!(first.parent_span_id, request.span_context.span_id());
    assert!(
        first.parent_span_is_remote,
        "the parent came through the outbox"
    );
    assert_eq!(attribute(&first, "event_id"), Some(id.to_string()));
    assert_eq!(
        attribute(&first, "event_type").as_deref(),
        Some("ORDER_STATUS_CHANGED")
    );
    // Across one follow-up: the first delivery is the second's parent.
    let second = delivery(&spans, "mailer");
    assert_eq!(second.span_context.trace_id(), trace);
    assert_eq!(second.parent_span_id, first.span_context.span_id());
    assert_ne!(second.parent_span_id, SpanId::INVALID);
    assert_eq!(
        attribute(&second, "event_type").as_deref(),
        Some("ORDER_NOTIFIED")
    );
    assert_eq!(attribute(&second, "causation_id"), Some(id.to_string()));
}
