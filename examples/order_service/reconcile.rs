//! The last line of defence: every COMPLETED order gets a COMPLETED notification, whether or
//! not an event ever said so (an import, a manual fix, a code path that forgot to enqueue).

use std::sync::Mutex;
use std::time::Duration;

use actix_outbox::{
    keys::claim_key, keys::KeyClaim, reconcile::ReconcileRule, transport::BoxFuture,
};
use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::consumers::{insert_job, notification_key};

/// Completed orders looked at per run: one page of `orders_completed_page`, so that a run's
/// search costs the same with a thousand orders or ten million, and never holds a snapshot
/// for long (a search that grew with the table held one for 11 minutes in a soak, and every
/// table's vacuum with it).
const PAGE: i64 = 1000;

pub struct CompletedWithoutNotification {
    /// How long the normal path (event → consumer) gets before a missing job counts as drift.
    window: Duration,
    /// Where the next page starts: past `(updated_at, id)`; back to the start once a page
    /// comes back short. Each instance keeps its own: pages looked at twice cost a read, and
    /// a repair is idempotent (its key).
    after: Mutex<Option<(DateTime<Utc>, String)>>,
}

impl CompletedWithoutNotification {
    pub fn new(window: Duration) -> Self {
        CompletedWithoutNotification {
            window,
            after: Mutex::new(None),
        }
    }
}

#[derive(QueryableByName)]
struct Looked {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Timestamptz)]
    updated_at: DateTime<Utc>,
    #[diesel(sql_type = Bool)]
    drifting: bool,
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
        let after = self.after.lock().map(|a| a.clone()).unwrap_or(None);
        let (at, id) = (after.as_ref().map(|a| a.0), after.map(|a| a.1));
        Box::pin(async move {
            // Late is not lost: an order whose event is still in the outbox or in the
            // notification inbox will get its job from the consumer, so it is not drift yet.
            let page: Vec<Looked> = diesel::sql_query(
                "SELECT o.id, o.updated_at, \
                        NOT EXISTS (SELECT 1 FROM notification_jobs j \
                                    WHERE j.order_id = o.id AND j.status = 'COMPLETED') \
                    AND NOT EXISTS (SELECT 1 FROM actix_outbox.outbox_events e WHERE e.aggregate_id = o.id \
                                    AND e.status IN ('PENDING', 'RETRY_PENDING', 'PROCESSING')) \
                    AND NOT EXISTS (SELECT 1 FROM actix_outbox.inbox_events i \
                                    WHERE i.consumer = 'notification' AND i.aggregate_id = o.id \
                                    AND i.status IN ('RECEIVED', 'RETRY_PENDING')) AS drifting \
                 FROM orders o \
                 WHERE o.status = 'COMPLETED' \
                   AND o.updated_at < now() - $1 * interval '1 millisecond' \
                   AND (o.updated_at, o.id) > (coalesce($3, '-infinity'), coalesce($4, '')) \
                 ORDER BY o.updated_at, o.id \
                 LIMIT $2",
            )
            .bind::<BigInt, _>(window_ms)
            .bind::<BigInt, _>(PAGE)
            .bind::<Nullable<Timestamptz>, _>(at)
            .bind::<Nullable<Text>, _>(id)
            .load(conn)
            .await?;
            let next = match page.last() {
                Some(last) if page.len() as i64 == PAGE => Some((last.updated_at, last.id.clone())),
                _ => None,
            };
            if let Ok(mut after) = self.after.lock() {
                *after = next;
            }
            Ok(page
                .into_iter()
                .filter(|o| o.drifting)
                .map(|o| o.id)
                .collect())
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
