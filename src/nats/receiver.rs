//! `NatsReceiver`: the receiving side of the bridge, an actor the runtime supervises.
//!
//! One loop: bind the durable pull consumer (creating the stream and the consumer when
//! missing), take the messages that are ready (up to `batch_size`), record them all in the
//! inbox in one transaction, commit, then acknowledge each. A crash anywhere before the
//! acknowledgements leaves the messages unacknowledged, so JetStream redelivers them after
//! `ack_wait`, and the inbox absorbs those already recorded. Several receivers (instances)
//! may share one durable consumer: JetStream gives each message to one of them at a time.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::AckKind;
use diesel_async::AsyncConnection;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::Notify;

use super::NatsStream;
use crate::error::{Error, ErrorCode, Result};
use crate::event::OutboxEvent;
use crate::messages::{Drain, InboxRowsWritten};
use crate::store::{self, PgPool};

/// How a [`NatsReceiver`] consumes its stream.
#[derive(Debug, Clone)]
pub struct NatsReceiverConfig {
    pub(crate) stream: NatsStream,
    pub(crate) durable: String,
    pub(crate) filter_subject: Option<String>,
    pub(crate) max_ack_pending: i64,
    pub(crate) ack_wait: Duration,
    pub(crate) batch_size: usize,
    pub(crate) max_backoff: Duration,
    /// Fault injection: the number of batches, counted across restarts, after whose commit the
    /// receiver panics before acknowledging (a crash between the commit and the ack).
    #[cfg(feature = "testing")]
    pub(crate) crash_before_ack: Arc<std::sync::atomic::AtomicU32>,
}

/// Setters, one per setting: start from [`NatsReceiverConfig::new`] and chain them.
impl NatsReceiverConfig {
    /// Consumes `stream` through the durable consumer `durable` (JetStream's name rules).
    /// Every receiver given the same pair shares one position in the stream.
    pub fn new(stream: NatsStream, durable: impl Into<String>) -> Self {
        NatsReceiverConfig {
            stream,
            durable: durable.into(),
            filter_subject: None,
            max_ack_pending: 1_000,
            ack_wait: Duration::from_secs(30),
            batch_size: 100,
            max_backoff: Duration::from_secs(5),
            #[cfg(feature = "testing")]
            crash_before_ack: Arc::default(),
        }
    }

    /// Only messages on this subject (wildcards allowed). Default: every subject of the stream.
    pub fn filter_subject(mut self, filter_subject: impl Into<String>) -> Self {
        self.filter_subject = Some(filter_subject.into());
        self
    }

    /// Messages delivered and not yet acknowledged, across every receiver of the durable
    /// consumer; JetStream delivers no more until some are acknowledged. Default 1,000.
    pub fn max_ack_pending(mut self, max_ack_pending: i64) -> Self {
        self.max_ack_pending = max_ack_pending;
        self
    }

    /// How long JetStream waits for an acknowledgement before it redelivers: the delay after
    /// a receiver died with messages in hand. Must be well above the time one batch's
    /// transaction takes. Default 30 s.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// The most messages recorded in one transaction. Default 100.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// The longest wait between two attempts to bind the consumer or commit a batch while
    /// NATS or PostgreSQL is unavailable (the wait doubles from 100 ms). Default 5 s.
    pub fn max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// Fault injection for tests: the next `batches` batches (counted across the receiver's
    /// restarts) commit their inbox rows and then panic before acknowledging, as a receiver
    /// killed between its commit and its ack would.
    #[cfg(feature = "testing")]
    pub fn crash_before_ack(self, batches: u32) -> Self {
        self.crash_before_ack
            .store(batches, std::sync::atomic::Ordering::Relaxed);
        self
    }

    fn validate(&self) -> Result<()> {
        self.stream.validate()?;
        let bad_durable = self.durable.is_empty()
            || self
                .durable
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'));
        if bad_durable
            || self.max_ack_pending < 1
            || self.ack_wait.is_zero()
            || self.batch_size == 0
            || self.max_backoff.is_zero()
        {
            return Err(Error::Config(format!(
                "NATS receiver {}: a valid durable name and positive max_ack_pending, ack_wait, \
                 batch_size and max_backoff are needed",
                self.durable
            )));
        }
        if self.batch_size as i64 > self.max_ack_pending {
            return Err(Error::Config(
                "NATS receiver: batch_size must not exceed max_ack_pending".into(),
            ));
        }
        Ok(())
    }
}

/// The receiving side of the bridge: a durable pull consumer whose messages become inbox rows
/// of this database. Register it with
/// [`OutboxBuilder::nats_receiver`](crate::OutboxBuilder::nats_receiver); the runtime runs
/// it as a supervised actor (restarted when it dies, drained at shutdown).
///
/// Each event is recorded for every consumer of this runtime's database subscribed to its
/// type, exactly as an in-process event would be, and from there delivered by the consumer
/// engine with the consumer's own retry policy and dead letters (the module docs of
/// [`nats`](crate::nats) say why the handler does not run in the receiving transaction).
#[derive(Clone)]
pub struct NatsReceiver {
    pub(crate) client: async_nats::Client,
    pub(crate) config: Arc<NatsReceiverConfig>,
    health: NatsHealth,
}

impl NatsReceiver {
    /// A receiver on `client` (see [`connect`](super::connect)). Nothing is contacted until the
    /// runtime starts it.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid settings.
    pub fn new(client: async_nats::Client, config: NatsReceiverConfig) -> Result<Self> {
        config.validate()?;
        Ok(NatsReceiver {
            client,
            config: Arc::new(config),
            health: NatsHealth::default(),
        })
    }

    /// A handle on this receiver's state, for a health endpoint; it stays valid across the
    /// actor's restarts.
    pub fn health(&self) -> NatsHealth {
        self.health.clone()
    }

    /// `nats:<stream>/<durable>`, the receiver's name in [`RuntimeStatus`](crate::health::RuntimeStatus).
    pub fn name(&self) -> String {
        format!("nats:{}/{}", self.config.stream.name, self.config.durable)
    }
}

/// The receiver's state, shared with its actor (see [`NatsReceiver::health`]).
#[derive(Clone, Default)]
pub struct NatsHealth(Arc<Mutex<NatsStatus>>);

/// What [`NatsHealth::status`] reports.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct NatsStatus {
    /// The durable consumer is bound and messages are flowing (or none are waiting).
    pub bound: bool,
    /// The last error (binding, fetching or committing), cleared by the next success.
    pub last_error: Option<String>,
    /// When that error happened.
    pub failing_since: Option<Instant>,
    /// Messages recorded and acknowledged since start.
    pub acked: u64,
    /// Of those, already in the inbox (redeliveries absorbed).
    pub duplicates: u64,
    /// Messages refused as undecodable (terminated, logged with `EVENT_SCHEMA_INVALID`).
    pub refused: u64,
}

impl NatsHealth {
    /// The current state.
    pub fn status(&self) -> NatsStatus {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Bound and without an error.
    pub fn is_healthy(&self) -> bool {
        let s = self.status();
        s.bound && s.last_error.is_none()
    }

    fn update(&self, f: impl FnOnce(&mut NatsStatus)) {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn failed(&self, error: &str) {
        self.update(|s| {
            s.last_error = Some(error.to_owned());
            s.failing_since.get_or_insert_with(Instant::now);
        });
    }

    /// The consumer is lost (NATS unreachable, the stream or consumer gone).
    fn unbound(&self, error: &str) {
        self.update(|s| s.bound = false);
        self.failed(error);
    }

    fn ok(&self) {
        self.update(|s| {
            s.bound = true;
            s.last_error = None;
            s.failing_since = None;
        });
    }
}

/// What the supervisor gives a receiver's actor.
pub(crate) struct ReceiverDeps {
    pub pool: PgPool,
    /// Where "inbox rows were written" goes, so this runtime's consumers claim them now.
    pub wake: Recipient<InboxRowsWritten>,
}

pub(crate) struct NatsReceiverActor {
    receiver: NatsReceiver,
    deps: Arc<ReceiverDeps>,
    /// Set by `Drain`: the loop stops after the batch in hand (committed and acknowledged).
    draining: Arc<Notify>,
    drain_flag: Arc<std::sync::atomic::AtomicBool>,
    /// Resolves when the loop has ended.
    done: Option<tokio::sync::watch::Receiver<bool>>,
}

impl NatsReceiverActor {
    pub(crate) fn new(receiver: NatsReceiver, deps: ReceiverDeps) -> Self {
        NatsReceiverActor {
            receiver,
            deps: Arc::new(deps),
            draining: Arc::new(Notify::new()),
            drain_flag: Arc::default(),
            done: None,
        }
    }
}

impl Actor for NatsReceiverActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if tokio::runtime::Handle::try_current().is_err() {
            ctx.stop();
            return;
        }
        let (tx, rx) = tokio::sync::watch::channel(false);
        self.done = Some(rx);
        let run = Loop {
            receiver: self.receiver.clone(),
            deps: self.deps.clone(),
            draining: self.draining.clone(),
            drain_flag: self.drain_flag.clone(),
        };
        ctx.spawn(
            async move {
                run.run().await;
                let _ = tx.send(true);
            }
            .into_actor(self),
        );
    }
}

impl Handler<Drain> for NatsReceiverActor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Drain, _: &mut Context<Self>) -> Self::Result {
        self.drain_flag
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.draining.notify_waiters();
        let done = self.done.clone();
        Box::pin(async move {
            if let Some(mut done) = done {
                let _ = done.wait_for(|d| *d).await;
            }
        })
    }
}

struct Loop {
    receiver: NatsReceiver,
    deps: Arc<ReceiverDeps>,
    draining: Arc<Notify>,
    drain_flag: Arc<std::sync::atomic::AtomicBool>,
}

type Messages = async_nats::jetstream::consumer::pull::Stream;

impl Loop {
    fn draining(&self) -> bool {
        self.drain_flag.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits `d`, or less if a drain begins.
    async fn pause(&self, d: Duration) {
        let drained = self.draining.notified();
        let slept = tokio::time::sleep(d);
        futures_util::pin_mut!(drained, slept);
        futures_util::future::select(drained, slept).await;
    }

    async fn run(self) {
        let cfg = &self.receiver.config;
        let health = &self.receiver.health;
        let mut backoff = Duration::from_millis(100);
        while !self.draining() {
            let mut messages = match self.bind().await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(receiver = %self.receiver.name(), error = %e, code = %e.code(),
                        "NATS receiver cannot bind its consumer; retrying");
                    health.unbound(&e.to_string());
                    self.pause(backoff).await;
                    backoff = (backoff * 2).min(cfg.max_backoff);
                    continue;
                }
            };
            health.ok();
            backoff = Duration::from_millis(100);
            loop {
                let batch = match self.next_batch(&mut messages).await {
                    Some(Ok(batch)) => batch,
                    Some(Err(e)) => {
                        tracing::warn!(receiver = %self.receiver.name(), error = %e,
                            "NATS receiver lost its consumer; binding again");
                        health.unbound(&e);
                        self.pause(backoff).await;
                        backoff = (backoff * 2).min(cfg.max_backoff);
                        break;
                    }
                    None => return, // draining
                };
                match self.record(batch).await {
                    Ok(()) => {
                        health.ok();
                        backoff = Duration::from_millis(100);
                    }
                    Err(e) => {
                        // Nothing acknowledged: JetStream redelivers after the nak's delay.
                        tracing::warn!(receiver = %self.receiver.name(), error = %e, code = %e.code(),
                            "NATS receiver could not record its batch; it is redelivered");
                        health.failed(&e.to_string());
                        self.pause(backoff).await;
                        backoff = (backoff * 2).min(cfg.max_backoff);
                    }
                }
                if self.draining() {
                    return;
                }
            }
        }
    }

    /// The stream and the durable consumer (made when missing), and its message stream.
    async fn bind(&self) -> Result<Messages> {
        let cfg = &self.receiver.config;
        let js = async_nats::jetstream::new(self.receiver.client.clone());
        cfg.stream.ensure(&js).await?;
        let fail = |e: &dyn std::fmt::Display| {
            Error::Config(format!("NATS consumer {}: {e}", cfg.durable))
        };
        let stream = js
            .get_stream(&cfg.stream.name)
            .await
            .map_err(|e| fail(&e))?;
        // A durable consumer this database bound before is never made anew: made anew, it
        // would deliver the whole stream again, and the events whose processed rows
        // retention deleted would be applied a second time.
        let pool = &self.deps.pool;
        let consumer: async_nats::jetstream::consumer::PullConsumer =
            match super::bindings::bound_before(pool, &cfg.stream.name, &cfg.durable).await? {
                // Only found, never made: a deletion between a look and a make would
                // otherwise make it anew all the same.
                Some(first) => super::bindings::found(&self.receiver, &stream, first).await?,
                None => stream
                    .get_or_create_consumer(
                        &cfg.durable,
                        pull::Config {
                            durable_name: Some(cfg.durable.clone()),
                            ack_policy: AckPolicy::Explicit,
                            deliver_policy: DeliverPolicy::All,
                            ack_wait: cfg.ack_wait,
                            max_ack_pending: cfg.max_ack_pending,
                            filter_subject: cfg.filter_subject.clone().unwrap_or_default(),
                            ..Default::default()
                        },
                    )
                    .await
                    .map_err(|e| fail(&e))?,
            };
        super::bindings::record(pool, &cfg.stream.name, &cfg.durable).await?;
        consumer
            .stream()
            .max_messages_per_batch(cfg.batch_size)
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
            .map_err(|e| fail(&e))
    }

    /// The next message (waiting for it, unless a drain begins), and those ready behind it.
    async fn next_batch(
        &self,
        messages: &mut Messages,
    ) -> Option<std::result::Result<Vec<async_nats::jetstream::Message>, String>> {
        let first = {
            let drained = self.draining.notified();
            futures_util::pin_mut!(drained);
            if self.draining() {
                return None;
            }
            match futures_util::future::select(drained, messages.next()).await {
                futures_util::future::Either::Left(_) => return None,
                futures_util::future::Either::Right((next, _)) => next,
            }
        };
        let first = match first {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Some(Err(e.to_string())),
            None => return Some(Err("the message stream ended".into())),
        };
        let mut batch = vec![first];
        while batch.len() < self.receiver.config.batch_size {
            match messages.next().now_or_never() {
                Some(Some(Ok(m))) => batch.push(m),
                // An error or the end is met again, and reported, at the next wait.
                _ => break,
            }
        }
        Some(Ok(batch))
    }

    /// Records a batch in one transaction, then acknowledges it; undecodable messages are
    /// terminated. On error nothing is acknowledged (the messages are nak'ed, redelivered).
    async fn record(&self, batch: Vec<async_nats::jetstream::Message>) -> Result<()> {
        let mut events: Vec<OutboxEvent> = Vec::with_capacity(batch.len());
        let mut good = Vec::with_capacity(batch.len());
        for msg in batch {
            match super::decode(&msg.payload, msg.headers.as_ref()) {
                Ok(e) => {
                    events.push(e);
                    good.push(msg);
                }
                Err(why) => {
                    // No event id to record it under: refused loudly, never retried.
                    tracing::error!(receiver = %self.receiver.name(), subject = %msg.subject,
                        code = %ErrorCode::EVENT_SCHEMA_INVALID, error = %why,
                        "NATS message refused: not an outbox event");
                    self.receiver.health.update(|s| s.refused += 1);
                    if let Err(e) = msg.ack_with(AckKind::Term).await {
                        tracing::warn!(error = %e, "could not terminate a refused message");
                    }
                }
            }
        }
        if events.is_empty() {
            return Ok(());
        }
        let committed = self.commit(&events).await;
        let (new, duplicates) = match committed {
            Ok(counts) => counts,
            // An error that a retry will not fix (an event PostgreSQL refuses): one event at a
            // time, so that the others are recorded and only that one waits.
            Err(e) if !e.is_transient() && events.len() > 1 => {
                tracing::warn!(receiver = %self.receiver.name(), error = %e,
                    "a batch could not be recorded; recording its events one at a time");
                return self.record_one_by_one(events, good).await;
            }
            Err(e) => {
                self.nak(&good).await;
                return Err(e);
            }
        };
        #[cfg(feature = "testing")]
        {
            use std::sync::atomic::Ordering;
            let crash = &self.receiver.config.crash_before_ack;
            if crash
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
            {
                panic!("fault injection: the NATS receiver dies after its commit, before its ack");
            }
        }
        for msg in &good {
            // A lost ack means one more redelivery, which the inbox absorbs.
            if let Err(e) = msg.ack().await {
                tracing::warn!(receiver = %self.receiver.name(), error = %e,
                    "ack failed; the message will be redelivered and absorbed");
            }
        }
        self.receiver.health.update(|s| {
            s.acked += good.len() as u64;
            s.duplicates += duplicates as u64;
        });
        if new > 0 {
            self.deps.wake.do_send(InboxRowsWritten {
                consumers: vec![("*".to_owned(), new)],
            });
        }
        Ok(())
    }

    /// Nothing recorded: JetStream redelivers after the longest backoff.
    async fn nak(&self, msgs: &[async_nats::jetstream::Message]) {
        let delay = self.receiver.config.max_backoff;
        for msg in msgs {
            let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
        }
    }

    /// Each event in a transaction of its own; acknowledged once recorded. One that cannot be
    /// recorded is never dropped: it is nak'ed (redelivered after the longest backoff) and
    /// logged with its id, and the receiver reports the error until it is recorded.
    async fn record_one_by_one(
        &self,
        events: Vec<OutboxEvent>,
        msgs: Vec<async_nats::jetstream::Message>,
    ) -> Result<()> {
        let mut failed = None;
        for (event, msg) in events.iter().zip(&msgs) {
            match self.commit(std::slice::from_ref(event)).await {
                Ok((new, duplicates)) => {
                    if let Err(e) = msg.ack().await {
                        tracing::warn!(error = %e, "ack failed; the message will be redelivered and absorbed");
                    }
                    self.receiver.health.update(|s| {
                        s.acked += 1;
                        s.duplicates += duplicates as u64;
                    });
                    if new > 0 {
                        self.deps.wake.do_send(InboxRowsWritten {
                            consumers: vec![("*".to_owned(), new)],
                        });
                    }
                }
                Err(e) => {
                    tracing::error!(receiver = %self.receiver.name(), event_id = %event.id,
                        error = %e, code = %e.code(), "an event could not be recorded; it is redelivered");
                    self.nak(std::slice::from_ref(msg)).await;
                    failed = Some(e);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// One transaction: every event's inbox rows. Returns (new rows, duplicates).
    async fn commit(&self, events: &[OutboxEvent]) -> Result<(usize, usize)> {
        let mut conn = self.deps.pool.get().await?;
        store::bounded(&mut conn, store::DB_TIMEOUT, async |conn| {
            conn.transaction::<_, Error, _>(async |conn| {
                let (mut new, mut dup) = (0, 0);
                for e in events {
                    let r = crate::inbox::receive(conn, e).await?;
                    new += r.new;
                    dup += r.duplicates;
                }
                Ok((new, dup))
            })
            .await
        })
        .await
    }
}
