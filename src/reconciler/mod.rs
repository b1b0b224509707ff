//! `ReconcilerActor`: the last layer. It periodically compares what should have happened with
//! what did, and reports drift that slipped past the outbox, the inbox and the idempotency keys.
//!
//! For now it runs the built-in checks only (events older than the consistency window that are
//! not yet published or processed, and dead letters); application rules with repairs come next.

use std::time::Duration;

use actix::prelude::*;
use diesel::sql_types::{BigInt, Double};
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;

use crate::runtime::Stop;
use crate::store::PgPool;

/// What the built-in checks found on their last run.
#[derive(Debug, Clone, Default, PartialEq, QueryableByName)]
pub struct DriftReport {
    /// Outbox rows still unpublished after the consistency window.
    #[diesel(sql_type = BigInt)]
    pub outbox_overdue: i64,
    /// Inbox rows still unprocessed after the consistency window.
    #[diesel(sql_type = BigInt)]
    pub inbox_overdue: i64,
    /// Outbox and inbox rows in DEAD_LETTER.
    #[diesel(sql_type = BigInt)]
    pub dead_letters: i64,
}

pub(crate) struct ReconcilerActor {
    pool: PgPool,
    interval: Duration,
    /// How late a follow-up may be before it counts as drift.
    window: Duration,
    last: Option<DriftReport>,
}

impl ReconcilerActor {
    pub(crate) fn new(pool: PgPool, interval: Duration, window: Duration) -> Self {
        ReconcilerActor {
            pool,
            interval,
            window,
            last: None,
        }
    }
}

async fn check(pool: PgPool, window: Duration) -> crate::Result<DriftReport> {
    let mut conn = pool.get().await?;
    let report = diesel::sql_query(
        "SELECT \
           (SELECT count(*) FROM outbox_events WHERE status IN ('PENDING', 'RETRY_PENDING', 'PROCESSING') \
              AND created_at < now() - $1 * interval '1 second') AS outbox_overdue, \
           (SELECT count(*) FROM inbox_events WHERE status IN ('RECEIVED', 'RETRY_PENDING') \
              AND received_at < now() - $1 * interval '1 second') AS inbox_overdue, \
           (SELECT count(*) FROM outbox_events WHERE status = 'DEAD_LETTER') + \
           (SELECT count(*) FROM inbox_events WHERE status = 'DEAD_LETTER') AS dead_letters",
    )
    .bind::<Double, _>(window.as_secs_f64())
    .get_result(&mut conn)
    .await?;
    Ok(report)
}

impl Actor for ReconcilerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.interval, |act, ctx| {
            let fut = check(act.pool.clone(), act.window);
            ctx.spawn(fut.into_actor(act).map(|res, act, _| match res {
                Ok(report) => {
                    if report.outbox_overdue + report.inbox_overdue + report.dead_letters > 0 {
                        tracing::warn!(?report, "reconciler found drift");
                    }
                    act.last = Some(report);
                }
                Err(e) => tracing::warn!(error = %e, "reconciler check failed"),
            }));
        });
    }
}

/// The last drift report, if a check has run.
#[derive(Message)]
#[rtype(result = "Option<DriftReport>")]
pub(crate) struct LastReport;

impl Handler<LastReport> for ReconcilerActor {
    type Result = Option<DriftReport>;
    fn handle(&mut self, _: LastReport, _: &mut Context<Self>) -> Option<DriftReport> {
        self.last.clone()
    }
}

impl Handler<Stop> for ReconcilerActor {
    type Result = ();
    fn handle(&mut self, stop: Stop, ctx: &mut Context<Self>) {
        if stop.panic {
            panic!("fault injection: reconciler panicked");
        }
        ctx.stop();
    }
}
