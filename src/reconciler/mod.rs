//! `ReconcilerActor`: the last layer. It periodically compares what should have happened with
//! what did, and repairs drift that slipped past the outbox, the inbox and the idempotency keys
//! (a code path that forgot to enqueue, a consumer bug, a dead letter someone ignored).
//!
//! Applications register [`ReconcileRule`]s. A repair runs in a transaction and must go through
//! the same business idempotency key as the normal path ([`claim_key`](crate::keys::claim_key)), so
//! a repair racing the normal path never duplicates an effect. Built-in checks report outbox and
//! inbox rows older than the consistency window and dead letters.

use std::rc::Rc;
use std::time::Duration;

use actix::prelude::*;
use diesel::sql_types::{BigInt, Bool, Integer, Text};
use diesel::QueryableByName;
use diesel_async::{
    AnsiTransactionManager as Tm, AsyncPgConnection, RunQueryDsl, TransactionManager,
};

use crate::error::Result;
use crate::event::redact::Redactor;
use crate::store::PgPool;

pub use crate::messages::BoxFuture;

/// A desired-vs-actual rule: a query that finds drift and a repair for one item.
///
/// ```ignore
/// impl ReconcileRule for MissingNotification {
///     fn name(&self) -> &str { "completed_order_without_notification" }
///     fn interval(&self) -> Duration { Duration::from_secs(60) }
///     fn find_drift<'a>(&'a self, conn: &'a mut AsyncPgConnection) -> BoxFuture<'a, Result<Vec<String>>> {
///         Box::pin(async move { /* SELECT id FROM orders WHERE status = 'COMPLETED' AND … */ })
///     }
///     fn repair<'a>(&'a self, conn: &'a mut AsyncPgConnection, key: &'a str) -> BoxFuture<'a, Result<bool>> {
///         Box::pin(async move { /* claim_key(conn, "notification:{key}:COMPLETED", …) then insert */ })
///     }
/// }
/// ```
pub trait ReconcileRule: 'static {
    /// A stable name: it keys the advisory lock, the `reconcile_runs` rows and logs.
    fn name(&self) -> &str;
    /// How often the rule runs.
    fn interval(&self) -> Duration;
    /// How long each statement of [`find_drift`](Self::find_drift) may run: it runs under this
    /// `statement_timeout`, so a search that grew slow (an anti-join over a backlog) is
    /// stopped by the server instead of holding a snapshot, and with it every table's
    /// vacuum, for minutes. A run stopped there is recorded with the code
    /// `RECONCILE_TIMEOUT` and runs again at the next interval. Default 30 s; page a search
    /// through an index (a bounded `LIMIT` from a key) rather than raise it.
    fn time_bound(&self) -> Duration {
        Duration::from_secs(30)
    }
    /// Returns the keys of items whose desired state lacks its actual state. The query itself
    /// should skip items younger than the rule's consistency window (normal processing may
    /// still be on its way).
    fn find_drift<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
    ) -> BoxFuture<'a, Result<Vec<String>>>;
    /// Repairs one item inside a transaction of its own. `Ok(true)` when it changed
    /// something, `Ok(false)` when the effect turned out to exist already (its idempotency key
    /// was taken). An error rolls back this item only.
    fn repair<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool>>;
}

/// What one run of one rule did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconcileReport {
    /// The rule's name.
    pub rule: String,
    /// Items found drifting.
    pub found: usize,
    /// Items repaired (0 in dry-run mode).
    pub repaired: usize,
    /// Repairs that failed; they are found again by the next run.
    pub failed: usize,
    /// Another instance held the rule's lock, so this run did nothing.
    pub skipped: bool,
    /// The run only reported.
    pub dry_run: bool,
}

/// Repairs per run at most, so one run's transaction stays short; the rest wait for the next.
const MAX_REPAIRS_PER_RUN: usize = 1000;

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
    rules: Vec<Rc<dyn ReconcileRule>>,
    interval: Duration,
    /// How late a follow-up may be before the built-in checks call it drift.
    window: Duration,
    dry_run: bool,
    /// What of a failed run's error `reconcile_runs` keeps.
    redact: Redactor,
    last: Option<DriftReport>,
}

impl ReconcilerActor {
    pub(crate) fn new(
        pool: PgPool,
        rules: Vec<Rc<dyn ReconcileRule>>,
        interval: Duration,
        window: Duration,
        dry_run: bool,
        redact: Redactor,
    ) -> Self {
        ReconcilerActor {
            pool,
            rules,
            interval,
            window,
            dry_run,
            redact,
            last: None,
        }
    }
}

async fn builtin_check(pool: PgPool, window: Duration) -> Result<DriftReport> {
    let mut conn = pool.get().await?;
    let report = crate::store::sql(
        "SELECT \
           (SELECT count(*) FROM actix_outbox.outbox_events WHERE status IN ('PENDING', 'RETRY_PENDING', 'PROCESSING') \
              AND created_at < now() - $1 * interval '1 millisecond') AS outbox_overdue, \
           (SELECT count(*) FROM actix_outbox.inbox_events WHERE status IN ('RECEIVED', 'RETRY_PENDING') \
              AND received_at < now() - $1 * interval '1 millisecond') AS inbox_overdue, \
           (SELECT count(*) FROM actix_outbox.outbox_events WHERE status = 'DEAD_LETTER') + \
           (SELECT count(*) FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER') AS dead_letters",
    )
    .bind::<BigInt, _>(crate::store::millis(window))
    .get_result(&mut conn)
    .await?;
    Ok(report)
}

#[derive(QueryableByName)]
struct Locked {
    #[diesel(sql_type = Bool)]
    locked: bool,
}

/// One run of one rule. The rule's advisory lock is held at session level for the whole run,
/// so only one instance runs it at a time; the search and each repair get transactions of their
/// own. One transaction for the whole run would hold every idempotency key it claimed until
/// the end, blocking (and deadlocking with) the consumers that claim the same keys.
async fn run_rule(
    pool: PgPool,
    rule: Rc<dyn ReconcileRule>,
    dry_run: bool,
    redact: Redactor,
) -> Result<ReconcileReport> {
    let mut report = ReconcileReport {
        rule: rule.name().to_owned(),
        dry_run,
        ..Default::default()
    };
    let mut held = Held(Some(pool.get_owned().await?));
    let conn = held.0.as_mut().expect("set just above");
    let lock: Locked = crate::store::sql(
        "SELECT pg_try_advisory_lock(hashtextextended('actix_outbox.reconcile:' || $1, 0)) AS locked",
    )
    .bind::<Text, _>(rule.name())
    .get_result(&mut *conn)
    .await?;
    if !lock.locked {
        report.skipped = true;
        held.release();
        return Ok(report);
    }
    let started = chrono::Utc::now();
    let outcome = repair_all(conn, &*rule, dry_run, &mut report).await;
    record_run(
        conn,
        rule.name(),
        dry_run,
        started,
        &report,
        outcome.as_ref().err(),
        &redact,
    )
    .await;
    let unlocked = crate::store::sql(
        "SELECT pg_advisory_unlock(hashtextextended('actix_outbox.reconcile:' || $1, 0))",
    )
    .bind::<Text, _>(rule.name())
    .execute(&mut **conn)
    .await;
    if unlocked.is_ok() {
        held.release();
    }
    outcome?;
    if report.found > 0 {
        tracing::warn!(
            rule = rule.name(),
            found = report.found,
            repaired = report.repaired,
            dry_run,
            "reconciler found drift"
        );
    }
    Ok(report)
}

/// A pooled connection holding a rule's session lock. Dropped while still held — the unlock
/// failed, or the run was cut off because its actor stopped or panicked — it marks the
/// connection broken, so the pool closes it and PostgreSQL releases the lock. Returned to the
/// pool healthy, the lock would stay with it, and every later run of the rule, on any
/// instance, would be skipped.
struct Held(Option<crate::store::OwnedConn>);

impl Held {
    /// The lock is gone (or was never taken): the connection goes back to the pool as it is.
    fn release(&mut self) {
        self.0 = None;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.0 {
            Tm::transaction_manager_status_mut(&mut **conn).set_in_error();
        }
    }
}

/// One `reconcile_runs` row for the run, failed or not, its error as `redact` leaves it. Not
/// recorded if the connection broke (the run's error is returned anyway).
async fn record_run(
    conn: &mut AsyncPgConnection,
    rule: &str,
    dry_run: bool,
    started: chrono::DateTime<chrono::Utc>,
    report: &ReconcileReport,
    error: Option<&crate::Error>,
    redact: &Redactor,
) {
    let recorded = crate::store::sql(
        "INSERT INTO actix_outbox.reconcile_runs (rule, dry_run, started_at, finished_at, found, repaired, error, \
             error_code) \
         VALUES ($1, $2, $3, now(), $4, $5, $6, $7)",
    )
    .bind::<Text, _>(rule)
    .bind::<Bool, _>(dry_run)
    .bind::<diesel::sql_types::Timestamptz, _>(started)
    .bind::<Integer, _>(report.found as i32)
    .bind::<Integer, _>(report.repaired as i32)
    .bind::<diesel::sql_types::Nullable<Text>, _>(
        error.map(|e| crate::store::inbox::error_text(redact, &e.to_string())),
    )
    .bind::<diesel::sql_types::Nullable<Text>, _>(error.map(|e| e.code().as_str().to_owned()))
    .execute(conn)
    .await;
    if let Err(e) = recorded {
        tracing::warn!(rule, error = %e, "could not record the reconcile run");
    }
}

#[derive(QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    previous: String,
}

/// The rule's search under its `statement_timeout` (set on the session for the search only,
/// then put back as it was). A statement the server cancelled for it is
/// [`Error::ReconcileTimeout`](crate::Error::ReconcileTimeout); any other error is the rule's
/// own, as it was.
async fn find_bounded(
    conn: &mut AsyncPgConnection,
    rule: &dyn ReconcileRule,
) -> Result<Vec<String>> {
    // At most what `statement_timeout` holds (about 24 days); zero is refused at start.
    let bound = rule
        .time_bound()
        .min(Duration::from_millis(i32::MAX as u64));
    let setting: Setting = crate::store::sql(
        "SELECT current_setting('statement_timeout') AS previous, \
                set_config('statement_timeout', $1, false) AS now",
    )
    .bind::<Text, _>(format!("{}ms", bound.as_millis()))
    .get_result(conn)
    .await?;
    let started = std::time::Instant::now();
    let found = rule.find_drift(conn).await;
    // diesel keeps no SQLSTATE (57014): the server's words, and the bound having passed. A
    // server that speaks another language records its own message under DATABASE_ERROR.
    let timed_out = match &found {
        Err(crate::Error::Database(e)) => {
            started.elapsed() >= bound && e.to_string().contains("statement timeout")
        }
        _ => false,
    };
    crate::store::sql("SELECT set_config('statement_timeout', $1, false)")
        .bind::<Text, _>(&setting.previous)
        .execute(conn)
        .await?;
    if timed_out {
        return Err(crate::Error::ReconcileTimeout(bound));
    }
    found
}

async fn repair_all(
    conn: &mut AsyncPgConnection,
    rule: &dyn ReconcileRule,
    dry_run: bool,
    report: &mut ReconcileReport,
) -> Result<()> {
    let keys = find_bounded(conn, rule).await?;
    report.found = keys.len();
    if !dry_run {
        for key in keys.iter().take(MAX_REPAIRS_PER_RUN) {
            Tm::begin_transaction(conn).await?;
            match rule.repair(conn, key).await {
                Ok(changed) => {
                    Tm::commit_transaction(conn).await?;
                    report.repaired += usize::from(changed);
                }
                Err(e) => {
                    Tm::rollback_transaction(conn).await?;
                    report.failed += 1;
                    tracing::warn!(rule = rule.name(), key, error = %e, "reconcile repair failed");
                }
            }
        }
    }
    Ok(())
}

impl Actor for ReconcilerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.interval, |act, ctx| {
            let fut = builtin_check(act.pool.clone(), act.window);
            ctx.spawn(fut.into_actor(act).map(|res, act, _| match res {
                Ok(report) => {
                    if report.outbox_overdue + report.inbox_overdue + report.dead_letters > 0 {
                        tracing::warn!(
                            ?report,
                            "outbox or inbox rows overdue, or dead letters present"
                        );
                    }
                    act.last = Some(report);
                }
                Err(e) => tracing::warn!(error = %e, "built-in reconcile check failed"),
            }));
        });
        for rule in &self.rules {
            let rule = rule.clone();
            ctx.run_interval(rule.interval(), move |act, ctx| {
                let fut = run_rule(
                    act.pool.clone(),
                    rule.clone(),
                    act.dry_run,
                    act.redact.clone(),
                );
                ctx.spawn(fut.into_actor(act).map(|res, _, _| {
                    if let Err(e) = res {
                        tracing::warn!(error = %e, "reconcile run failed");
                    }
                }));
            });
        }
    }
}

/// The last built-in drift report, if a check has run.
#[derive(Message)]
#[rtype(result = "Option<DriftReport>")]
pub(crate) struct LastReport;

impl Handler<LastReport> for ReconcilerActor {
    type Result = Option<DriftReport>;
    fn handle(&mut self, _: LastReport, _: &mut Context<Self>) -> Option<DriftReport> {
        self.last.clone()
    }
}

/// Run every rule now, one after another, and report.
#[derive(Message)]
#[rtype(result = "Vec<Result<ReconcileReport>>")]
pub(crate) struct RunNow;

impl Handler<RunNow> for ReconcilerActor {
    type Result = ResponseFuture<Vec<Result<ReconcileReport>>>;
    fn handle(&mut self, _: RunNow, _: &mut Context<Self>) -> Self::Result {
        let (pool, rules, dry_run) = (self.pool.clone(), self.rules.clone(), self.dry_run);
        let redact = self.redact.clone();
        Box::pin(async move {
            let mut reports = Vec::with_capacity(rules.len());
            for rule in rules {
                reports.push(run_rule(pool.clone(), rule, dry_run, redact.clone()).await);
            }
            reports
        })
    }
}
