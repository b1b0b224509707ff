//! The consumer's reaper: settles the leases that expired, which only a loop that died leaves
//! behind (its process was killed, its database backend crashed, its connection stopped
//! answering). On each poll it first judges the processes holding an expired lease of its
//! consumer: each row such a process held learns how many rows that was (`held`), in one
//! statement for every consumer's rows. Then it settles its own consumer's judged rows by its
//! retry policy ([`settle_expired`](super::decide::settle_expired)). Any instance may settle a
//! lease left by another; the marks are fenced on the lease, so none is settled twice.

use super::decide::settle_expired;
use super::ConsumerConfig;
use crate::error::Result;
use crate::store::inbox::{self, Settle};
use crate::store::{self, PgPool, DB_TIMEOUT};
use crate::telemetry::metrics;
use diesel_async::AsyncPgConnection;

/// Rows settled per reap; the next poll takes the rest.
const ROWS_PER_REAP: i64 = 1000;

/// Judges dead processes and settles up to [`ROWS_PER_REAP`] of the consumer's rows they
/// held. Returns how many rows were settled.
pub(crate) async fn reap(pool: &PgPool, cfg: &ConsumerConfig) -> Result<usize> {
    let mut conn = pool.get().await?;
    let reaped = reap_on(&mut conn, cfg).await;
    if reaped.is_err() {
        // Its statements fail only with their connection (a terminated session's first error
        // is the server's, with its own code): not lent again.
        crate::store::poison(&mut conn);
    }
    reaped
}

async fn reap_on(conn: &mut AsyncPgConnection, cfg: &ConsumerConfig) -> Result<usize> {
    // A live process settles its leases before they expire; one that has not, a patience
    // later, is stuck and judged too.
    let patience = crate::store::millis(super::decide::patience(cfg));
    let name = cfg.name.as_str();
    store::bounded(conn, DB_TIMEOUT, async |c| {
        inbox::judge_dead(c, name, patience).await
    })
    .await?;
    // A judged cursor lease names events, not rows: they get inbox rows first.
    store::bounded(conn, DB_TIMEOUT, async |c| {
        inbox::cursor::promote_judged(c, name).await
    })
    .await?;
    let judged = store::bounded(conn, DB_TIMEOUT, async |c| {
        inbox::judged(c, name, ROWS_PER_REAP).await
    })
    .await?;
    if judged.is_empty() {
        return Ok(0);
    }
    let outcomes = settle_expired(&cfg.retry, &judged);
    let settled = store::bounded(conn, DB_TIMEOUT, async |c| {
        inbox::settle_now(c, &outcomes, &cfg.redact).await
    })
    .await?;
    let (mut charged, mut dead) = (0, 0);
    for (row, o) in judged.iter().zip(&outcomes) {
        match &o.settle {
            Settle::Died { failure: f, .. } => {
                charged += 1;
                dead += u64::from(f.dead);
                tracing::warn!(
                    consumer = %cfg.name, event_id = %row.event_id, attempt = row.attempt_count + 1,
                    dead = f.dead, code = %f.code, error = %f.message,
                    "its process died during its attempt, which counts"
                );
            }
            _ => tracing::warn!(
                consumer = %cfg.name, event_id = %row.event_id, held = row.held,
                "its process died holding it and other events: not counted; handled alone from now on"
            ),
        }
    }
    metrics::inbox_failed(cfg.name.as_str(), charged);
    metrics::inbox_dead_lettered(cfg.name.as_str(), dead);
    Ok(settled)
}
