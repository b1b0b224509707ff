//! The notification worker: sends `notification_jobs` to the (fake) provider.
//!
//! It runs outside any inbox transaction on purpose. A provider call cannot be rolled back, so
//! it must not sit inside a transaction that might be; the consumer only records the intent
//! (a job row) and this worker makes the call with its own retries. A job is leased, not
//! locked, while it is sent: no transaction stays open across the network call, and a worker
//! that dies mid-send leaves a lease that simply runs out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix_outbox::PgPool;
use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;
use futures_util::future::join_all;
use tokio::sync::oneshot;

use crate::rng;

/// Jobs per claim: small, so a batch's lease covers only a few sends.
const BATCH: i64 = 50;
/// How long a claimed job stays the claimer's before another worker may take it over.
const LEASE_MS: i64 = 10_000;
/// Sends in all before a job is FAILED for an operator to look at.
const MAX_ATTEMPTS: i32 = 10;
const TICK: Duration = Duration::from_millis(100);

pub struct NotificationWorker {
    pool: PgPool,
    fail_rate: f64,
    busy: bool,
    /// Read by the running loop between batches, so a stop does not wait for a whole backlog.
    stopping: Arc<AtomicBool>,
    stopped: Vec<oneshot::Sender<()>>,
}

impl NotificationWorker {
    pub fn new(pool: PgPool, fail_rate: f64) -> Self {
        NotificationWorker {
            pool,
            fail_rate,
            busy: false,
            stopping: Arc::new(AtomicBool::new(false)),
            stopped: Vec::new(),
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy || stopped(&self.stopping) {
            return;
        }
        self.busy = true;
        let (pool, fail_rate, stopping) =
            (self.pool.clone(), self.fail_rate, self.stopping.clone());
        let run = async move {
            loop {
                let claimed = send_batch(&pool, fail_rate).await?;
                if claimed < BATCH as usize || stopped(&stopping) {
                    return Ok::<_, actix_outbox::Error>(());
                }
            }
        };
        ctx.spawn(run.into_actor(self).map(|res, act, ctx| {
            act.busy = false;
            if let Err(e) = res {
                tracing::warn!(error = %e, "notification worker batch failed; retrying at the next tick");
            }
            if stopped(&act.stopping) {
                for tx in act.stopped.drain(..) {
                    let _ = tx.send(());
                }
                ctx.stop();
            }
        }));
    }
}

/// `RunQueryDsl::load` is implemented for every type, so the atomic's `load` needs its path.
fn stopped(flag: &AtomicBool) -> bool {
    AtomicBool::load(flag, Ordering::Relaxed)
}

impl Actor for NotificationWorker {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(TICK, |act, ctx| act.tick(ctx));
    }
}

/// Stop claiming; resolves once the batch in flight has been marked.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Stop;

impl Handler<Stop> for NotificationWorker {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Stop, ctx: &mut Context<Self>) -> Self::Result {
        self.stopping.store(true, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        if self.busy {
            self.stopped.push(tx);
        } else {
            let _ = tx.send(());
            ctx.stop();
        }
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

#[derive(QueryableByName)]
struct Job {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

/// Claims due jobs (and jobs whose sender's lease ran out), sends them, records the outcomes.
/// Returns how many it claimed.
async fn send_batch(pool: &PgPool, fail_rate: f64) -> actix_outbox::Result<usize> {
    let mut conn = pool.get().await?;
    let jobs: Vec<Job> = diesel::sql_query(
        "WITH due AS ( \
             SELECT id FROM notification_jobs \
             WHERE state IN ('PENDING', 'SENDING') AND next_attempt_at <= now() \
             ORDER BY next_attempt_at, id LIMIT $1 \
             FOR UPDATE SKIP LOCKED \
         ) \
         UPDATE notification_jobs j \
         SET state = 'SENDING', attempts = j.attempts + 1, updated_at = now(), \
             next_attempt_at = now() + $2 * interval '1 millisecond' \
         FROM due WHERE j.id = due.id \
         RETURNING j.id, j.key, j.attempts",
    )
    .bind::<BigInt, _>(BATCH)
    .bind::<BigInt, _>(LEASE_MS)
    .load(&mut conn)
    .await?;
    if jobs.is_empty() {
        return Ok(0);
    }
    // Not while sending: the connection would idle through every provider round trip.
    drop(conn);

    let outcomes = join_all(jobs.iter().map(|job| provider_send(&job.key, fail_rate))).await;

    let ids: Vec<i64> = jobs.iter().map(|j| j.id).collect();
    let attempts: Vec<i32> = jobs.iter().map(|j| j.attempts).collect();
    let ok: Vec<bool> = outcomes.iter().map(Result::is_ok).collect();
    let errors: Vec<Option<String>> = outcomes.into_iter().map(Result::err).collect();
    let mut conn = pool.get().await?;
    // Fenced on the attempt number: if the lease ran out and another worker took the job
    // over, its outcome wins and this one is dropped.
    diesel::sql_query(
        "UPDATE notification_jobs j \
         SET state = CASE WHEN r.ok THEN 'SENT' WHEN j.attempts >= $5 THEN 'FAILED' ELSE 'PENDING' END, \
             sent_at = CASE WHEN r.ok THEN now() END, \
             next_attempt_at = CASE WHEN r.ok THEN now() \
                 ELSE now() + least(5000, 200 * 2 ^ (j.attempts - 1)) * interval '1 millisecond' END, \
             last_error = r.error, updated_at = now() \
         FROM unnest($1::int8[], $2::int4[], $3::bool[], $4::text[]) AS r(id, attempts, ok, error) \
         WHERE j.id = r.id AND j.attempts = r.attempts AND j.state = 'SENDING'",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Array<Integer>, _>(attempts)
    .bind::<Array<Bool>, _>(ok)
    .bind::<Array<Nullable<Text>>, _>(errors)
    .bind::<Integer, _>(MAX_ATTEMPTS)
    .execute(&mut conn)
    .await?;
    Ok(jobs.len())
}

/// The fake provider: a few milliseconds of latency, then success or a failure at
/// `PROVIDER_FAIL_RATE`. A real one would get `key` as its idempotency key, so that a job sent
/// twice (its SENT mark was lost) reaches the customer once.
async fn provider_send(key: &str, fail_rate: f64) -> Result<(), String> {
    let (latency, fail) = (rng::between(1, 8), rng::chance(fail_rate));
    actix_rt::time::sleep(Duration::from_millis(latency)).await;
    if fail {
        return Err(format!("provider refused {key} (PROVIDER_FAIL_RATE)"));
    }
    Ok(())
}
