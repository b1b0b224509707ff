//! The last line of defence: every COMPLETED order gets a COMPLETED notification, whether or
//! not an event ever said so (an import, a manual fix, a code path that forgot to enqueue).

use std::time::Duration;

use actix_outbox::{
    keys::claim_key, keys::KeyClaim, reconcile::ReconcileRule, transport::BoxFuture,
};
use diesel::sql_types::{BigInt, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::consumers::{insert_job, notification_key};

/// Few per run, so that a run, which holds the reconciler's lock, stays short.
const REPAIRS_PER_RUN: i64 = 200;

pub struct CompletedWithoutNotification {
    /// How long the normal path (event → consumer) gets before a missing job counts as drift.
    window: Duration,
}

impl CompletedWithoutNotification {
    pub fn new(window: Duration) -> Self {
        CompletedWithoutNotification { window }
    }
}

#[derive(QueryableByName)]
struct OrderId {
    #[diesel(sql_type = Text)]
    id: String,
}

impl ReconcileRule for CompletedWithoutNotification {
    fn name(&self) -> &str {
        "completed_order_without_notification"
    }

    fn interval(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn find_drift<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
    ) -> BoxFuture<'a, actix_outbox::Result<Vec<String>>> {
        let window_ms = self.window.as_millis().min(i64::MAX as u128) as i64;
        Box::pin(async move {
            // Late is not lost: an order whose event is still in the outbox or in the
            // notification inbox will get its job from the consumer, so it is not drift yet.
            let rows: Vec<OrderId> = diesel::sql_query(
                "SELECT o.id FROM orders o \
                 WHERE o.status = 'COMPLETED' \
                   AND o.updated_at < now() - $1 * interval '1 millisecond' \
                   AND NOT EXISTS (SELECT 1 FROM notification_jobs j \
                                   WHERE j.order_id = o.id AND j.status = 'COMPLETED') \
                   AND NOT EXISTS (SELECT 1 FROM actix_outbox.outbox_events e WHERE e.aggregate_id = o.id \
                                   AND e.status IN ('PENDING', 'RETRY_PENDING', 'PROCESSING')) \
                   AND NOT EXISTS (SELECT 1 FROM actix_outbox.inbox_events i \
                                   WHERE i.consumer = 'notification' AND i.aggregate_id = o.id \
                                   AND i.status IN ('RECEIVED', 'RETRY_PENDING')) \
                 ORDER BY o.updated_at \
                 LIMIT $2",
            )
            .bind::<BigInt, _>(window_ms)
            .bind::<BigInt, _>(REPAIRS_PER_RUN)
            .load(conn)
            .await?;
            Ok(rows.into_iter().map(|r| r.id).collect())
        })
    }

    fn repair<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        order_id: &'a str,
    ) -> BoxFuture<'a, actix_outbox::Result<bool>> {
        Box::pin(async move {
            let key = notification_key(order_id, "COMPLETED");
            // A claim waits for a consumer that holds the same key (its batch has not
            // committed), and the run repairs one item after another: waiting would hold up
            // the run for as long as that batch lasts. Give up quickly instead (this repair's
            // transaction only): the item is found again next run, by when the consumer has
            // committed or rolled back.
            diesel::sql_query("SET LOCAL lock_timeout = '100ms'")
                .execute(&mut *conn)
                .await?;
            match claim_key(conn, &key, self.name(), None).await? {
                KeyClaim::AlreadyDone => Ok(false),
                KeyClaim::Claimed => {
                    insert_job(conn, order_id, "COMPLETED", &key, self.name()).await?;
                    Ok(true)
                }
            }
        })
    }
}
