//! The two consumers of `ORDER_STATUS_CHANGED`. Each writes its effect through the delivery's
//! connection ([`Delivery::conn`], [`DeliveryBatch::conn`]), so the effect commits with the
//! inbox's PROCESSED mark or not at all.

use actix::prelude::*;
use actix_outbox::{
    db::Prepared, keys::claim_key, keys::KeyClaim, Delivery, DeliveryBatch, HandlerError, PgPool,
};
use diesel::sql_types::{Array, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde::Deserialize;

use crate::rng;

/// The payload of `ORDER_STATUS_CHANGED`.
#[derive(Debug, Deserialize)]
struct StatusChanged {
    order_id: String,
    status: String,
}

/// The business idempotency key of "tell the customer that `order_id` became `status`". The
/// consumer and the reconciler both claim it, so whichever comes second does nothing.
pub fn notification_key(order_id: &str, status: &str) -> String {
    format!("notification:{order_id}:{status}")
}

/// Writes the notification owed (a `notification_jobs` row) and records its sending as a side
/// effect. Call only after claiming its key in the same transaction.
pub async fn insert_job(
    conn: &mut AsyncPgConnection,
    order_id: &str,
    status: &str,
    key: &str,
    created_by: &str,
) -> actix_outbox::Result<()> {
    Prepared(
        diesel::sql_query(
            "INSERT INTO notification_jobs (order_id, status, key, created_by) VALUES ($1, $2, $3, $4)",
        )
        .bind::<Text, _>(order_id)
        .bind::<Text, _>(status)
        .bind::<Text, _>(key)
        .bind::<Text, _>(created_by),
    )
    .execute(conn)
    .await?;
    crate::worker::record(conn, order_id, status, key).await
}

/// Counts the call on a connection of its own, outside the delivery's transaction: a call whose
/// transaction is later rolled back (the process died) must still count, or redeliveries would
/// be invisible. Best effort; it is a metric.
///
/// `synchronous_commit = off` because waiting for a WAL flush here would stall every delivery
/// for a number that only a crash of PostgreSQL itself (not of this service) could lose. It is
/// set per session, which is why these writes have a pool of their own.
async fn record_calls(pool: &PgPool, deliveries: &[Delivery]) {
    let Some(first) = deliveries.first() else {
        return;
    };
    // Both values are safe to inline: a consumer name is `[A-Za-z0-9_.-]`, an event id a UUID.
    let ids: Vec<String> = deliveries
        .iter()
        .map(|d| format!("'{}'", d.event_id()))
        .collect();
    let sql = format!(
        "SET synchronous_commit = off; \
         INSERT INTO handler_calls (consumer, event_id) \
         SELECT '{}', unnest(ARRAY[{}]::uuid[]) \
         ON CONFLICT (consumer, event_id) DO UPDATE SET calls = handler_calls.calls + 1",
        first.consumer(),
        ids.join(",")
    );
    let recorded = async {
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        conn.batch_execute(&sql).await.map_err(|e| e.to_string())
    }
    .await;
    if let Err(e) = recorded {
        tracing::debug!(consumer = %first.consumer(), error = %e, "could not count handler calls");
    }
}

/// Fails an attempt with probability `rate`, after the handler's writes: the savepoint
/// rollback, not the handler, is what must keep the effect from repeating on the retry.
fn injected_failure(rate: f64) -> Result<(), HandlerError> {
    if rng::chance(rate) {
        return Err(HandlerError::retry("injected failure (CONSUMER_FAIL_RATE)"));
    }
    Ok(())
}

/// Turns each status change into one `notification_jobs` row.
pub struct NotificationConsumer {
    metrics_pool: PgPool,
    fail_rate: f64,
}

impl NotificationConsumer {
    pub fn new(metrics_pool: PgPool, fail_rate: f64) -> Self {
        NotificationConsumer {
            metrics_pool,
            fail_rate,
        }
    }
}

impl Actor for NotificationConsumer {
    type Context = Context<Self>;
}

impl Handler<Delivery> for NotificationConsumer {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let (metrics_pool, fail_rate) = (self.metrics_pool.clone(), self.fail_rate);
        Box::pin(async move {
            record_calls(&metrics_pool, std::slice::from_ref(&d)).await;
            let change: StatusChanged = d.decode()?;
            let key = notification_key(&change.order_id, &change.status);
            let mut conn = d.conn().await?;
            match claim_key(&mut conn, &key, "notification", Some(d.event_id())).await? {
                KeyClaim::Claimed => {
                    insert_job(
                        &mut conn,
                        &change.order_id,
                        &change.status,
                        &key,
                        "notification",
                    )
                    .await?;
                }
                // The reconciler (or another event) got there first: a duplicate absorbed.
                // Not counted here: a shared counter row would serialise the consumer's
                // concurrent batches; /stats derives the number from the jobs instead.
                KeyClaim::AlreadyDone => {}
            }
            drop(conn);
            injected_failure(fail_rate)
        })
    }
}

/// Counts status changes per status in `order_status_counts`: a batch consumer, because every
/// event adds to one of a few hot rows. Given a whole batch it adds each status's count with
/// one statement, instead of one round trip and one row update per event.
pub struct AnalyticsConsumer {
    metrics_pool: PgPool,
    fail_rate: f64,
}

impl AnalyticsConsumer {
    pub fn new(metrics_pool: PgPool, fail_rate: f64) -> Self {
        AnalyticsConsumer {
            metrics_pool,
            fail_rate,
        }
    }
}

impl Actor for AnalyticsConsumer {
    type Context = Context<Self>;
}

impl Handler<DeliveryBatch> for AnalyticsConsumer {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, b: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        let (metrics_pool, fail_rate) = (self.metrics_pool.clone(), self.fail_rate);
        Box::pin(async move {
            record_calls(&metrics_pool, b.deliveries()).await;
            let statuses = b
                .deliveries()
                .iter()
                .map(|d| d.decode::<StatusChanged>().map(|c| c.status))
                .collect::<Result<Vec<String>, HandlerError>>()?;
            // A counter is not idempotent by itself: the inbox (one PROCESSED mark per event,
            // in this same transaction) is what makes each event count once.
            let mut conn = b.conn().await?;
            Prepared(
                diesel::sql_query(
                    "INSERT INTO order_status_counts (status, count) \
                     SELECT s, count(*) FROM unnest($1::text[]) AS s GROUP BY s \
                     ON CONFLICT (status) DO UPDATE \
                     SET count = order_status_counts.count + excluded.count",
                )
                .bind::<Array<Text>, _>(&statuses),
            )
            .execute(&mut *conn)
            .await?;
            drop(conn);
            // Each call fails at the injected rate, as a transient database error would; the
            // runtime then replays the batch one event per call, counting one attempt.
            injected_failure(fail_rate)
        })
    }
}
