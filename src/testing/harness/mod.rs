//! The in-memory actor harness (feature `testing`): the runtime's delivery logic without
//! PostgreSQL and without real time, so that consumer actors and the runtime's own rules
//! (retry timing, pause, handler supervision, fan-out) are tested fast and deterministically.
//!
//! It models the outbox and inbox state machines of `store/outbox.rs` and `store/inbox.rs` in
//! memory and reuses the runtime's decisions (`consumer::decide`, `consumer::upcast`, the
//! [`RetryPolicy`](crate::RetryPolicy) math) instead of copying them. Its limits: handlers get
//! a database connection only from a harness built with [`Harness::with_database`] (then each
//! attempt is a real transaction, and only the inbox and outbox stay in memory), a failed
//! attempt's in-memory side effects stay, consumers and rows are driven one at a time.
//! `tests/harness.rs` runs one scripted scenario through this model and through the runtime on
//! PostgreSQL and compares every inbox row, which keeps the model honest. The user-facing
//! docs are on [`Harness`].
//!
//! Here: [`Harness`] and its public steps. `model.rs`: the rows and views it keeps.
//! `cycle.rs`: one delivery, marked as the runtime marks it. `database.rs`: an attempt's
//! transaction, with a database. `redelivery.rs`: the crash-and-redeliver check.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use chrono::{DateTime, TimeDelta, Utc};

use crate::consumer::actor::HandlerRef;
use crate::consumer::{ConsumerConfig, Delivery, DeliveryBatch};
use crate::error::{Error, Result};
use crate::event::{EventId, EventRegistry, NewEvent, PayloadRules};
use crate::store::inbox::InboxRow;
use crate::store::PgPool;

mod cycle;
mod database;
mod model;
mod redelivery;
mod switches;

use cycle::unique_violation;
use model::*;
pub use model::{InboxStatus, InboxView, OutboxStatus, OutboxView, Outcome};
pub use redelivery::{EffectChanges, RedeliveryCheck, RedeliveryReport};

/// An in-memory outbox, inbox and consumer runtime with a manual clock: the runtime's
/// delivery logic without PostgreSQL and without real time, for fast, deterministic tests of
/// consumer actors.
///
/// The harness keeps an outbox and an inbox in memory that follow the runtime's SQL state
/// machines step for step, and it hands rows to *real* actix
/// actors as real [`Delivery`] messages. What it decides is decided by the same code the
/// runtime runs: the retry decision, the [`RetryPolicy`](crate::RetryPolicy) math, the
/// upcasting of old event versions, the handler-timeout and lost-handler rules. The test drives
/// it one step at a time:
///
/// - [`Harness::publish`] is one publisher cycle: every pending outbox row becomes PUBLISHED and
///   gets one inbox row per subscribed consumer; a row that already exists is absorbed and
///   counted as a duplicate ([`Harness::duplicates`]).
/// - [`Harness::deliver`] is one delivery cycle: every inbox row due by the manual clock, per
///   consumer in claim order, goes to that consumer's actor; the outcome is marked as the
///   runtime would mark it (PROCESSED, RETRY_PENDING at `now + delay`, DEAD_LETTER).
/// - [`Harness::advance`] moves the manual clock; a retry fires only once the clock has passed
///   its `next_attempt_at`. Nothing ever sleeps.
/// - [`Harness::deliver_out_of_order`] and [`Harness::redeliver`] deliver chosen events in a
///   chosen order, or again, as concurrency and crashes do in production.
/// - [`Harness::pause`] / [`Harness::resume`] are the consumer's pause switch.
/// - [`Harness::check_redelivery`], with a database ([`Harness::with_database`]), crashes each
///   due delivery before its commit, delivers it again, and reports the events whose effects
///   the crash repeated.
///
/// A handler actor that stops while handling (a panic in `handle`) fails that attempt exactly as
/// in the runtime and is rebuilt from its factory before the next delivery
/// ([`Harness::handler_restarts`] counts the rebuilds). A panic inside the future a handler
/// returns (`ResponseFuture`) fails the attempt too, but does not stop the actor: actix runs
/// that future as a task of its own, so nothing is rebuilt, in the runtime as here.
///
/// # Limits
///
/// - **A database only when given one.** A [`Delivery`] made by [`Harness::new`] has no
///   connection: [`Delivery::conn`] (and everything built on it, such as
///   [`Delivery::enqueue`]) returns a retryable [`HandlerError`](crate::HandlerError), so such
///   an attempt fails. Build the harness with [`Harness::with_database`] to run handlers that
///   write: each attempt is then a real transaction on that database, committed or rolled back
///   as the runtime would.
/// - **Only the database is transactional.** A failed attempt's in-memory side effects stay,
///   and so do writes made outside the delivery's transaction (a pool connection of the
///   handler's own); with a database, the writes made through [`Delivery::conn`] roll back,
///   as in the runtime. [`Harness::check_redelivery`] finds the consumers whose outside writes
///   a crash would repeat. The inbox and outbox are in memory either way: a follow-up a
///   handler enqueues lands in the database's `outbox_events`, not in the harness's outbox.
/// - **One process, one handler at a time.** Consumers are driven one after the other and rows
///   one after the other. The runtime's `concurrency`, `batch_size`, `pipeline` and
///   `rate_limit` are not modelled, nor is `ordered` (here an aggregate's next event does not
///   wait for a failed one: test an ordered consumer's waiting with the runtime). They change how fast rows are handled, and two things more: with `skip_stale`,
///   concurrent batches may take an aggregate's events out of order (test that with
///   [`Harness::deliver_out_of_order`]); and a failure in a batch rolls back the writes of the
///   rows handled before it in that batch (for a [`DeliveryBatch`] handler, of the whole
///   batch), which the runtime then hands over again. Here each row is called once per
///   attempt, as the failing row is in the runtime; a handler whose calls are counted outside
///   the database may see more calls there. Nor are the runtime's own actors (publisher,
///   registry, `ConsumerActor`) and their supervisor restarts modelled; only the handler actors
///   are real.
/// - **Handler timeouts use the real clock**, as in the runtime: a handler that does not finish
///   within [`ConsumerConfig::handler_timeout`] fails its attempt. Set a short timeout in a test
///   that exercises it.
///
/// Whether the model stays faithful is checked by `tests/harness.rs`, which runs one scripted
/// scenario through the harness and through the runtime on PostgreSQL and compares every
/// inbox row's status, attempt count and error code.
///
/// # Example
///
/// ```
/// use std::time::Duration;
///
/// use actix::prelude::*;
/// use actix_outbox::testing::{Harness, InboxStatus};
/// use actix_outbox::{ConsumerConfig, Delivery, HandlerError, NewEvent, RetryPolicy};
///
/// /// Fails the first attempt of every event.
/// struct Mailer;
/// impl Actor for Mailer {
///     type Context = Context<Self>;
/// }
/// impl Handler<Delivery> for Mailer {
///     type Result = Result<(), HandlerError>;
///     fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
///         if d.attempt() == 1 {
///             return Err(HandlerError::retry("mail server busy"));
///         }
///         Ok(())
///     }
/// }
///
/// # fn main() -> actix_outbox::Result<()> {
/// actix_rt::System::new().block_on(async {
///     let mut h = Harness::new();
///     let retry = RetryPolicy::fixed(3, Duration::from_secs(60));
///     h.consumer(ConsumerConfig::new("mailer").subscribe("ORDER_PLACED").retry(retry), || Mailer)?;
///
///     let id = h.enqueue(&NewEvent::new("ORDER_PLACED", "order", "o1", serde_json::json!({})))?;
///     assert_eq!(h.publish(), 1);
///     h.deliver().await; // attempt 1 fails
///     assert_eq!(h.row("mailer", id).unwrap().status, InboxStatus::RetryPending);
///
///     h.advance(Duration::from_secs(59));
///     assert!(h.deliver().await.is_empty(), "not due before its backoff");
///     h.advance(Duration::from_secs(1));
///     h.deliver().await; // attempt 2 succeeds
///     let row = h.row("mailer", id).unwrap();
///     assert_eq!((row.status, row.attempts), (InboxStatus::Processed, 2));
///     Ok(())
/// })
/// # }
/// ```
///
/// Must be used inside an actix system (`#[actix_rt::test]`, `actix_rt::System::new()`):
/// consumers are real actors.
pub struct Harness {
    now: DateTime<Utc>,
    /// In `seq` order.
    outbox: Vec<OutboxEntry>,
    /// In `id` order.
    inbox: Vec<InboxEntry>,
    next_inbox_id: i64,
    /// In registration order, which is the order [`Harness::deliver`] visits them in.
    consumers: Vec<ConsumerSlot>,
    events: Option<Arc<EventRegistry>>,
    /// Where attempts run their transactions ([`Harness::with_database`]); `None`: deliveries
    /// have no connection.
    database: Option<PgPool>,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("now", &self.now)
            .field("outbox", &self.outbox.len())
            .field("inbox", &self.inbox.len())
            .field(
                "consumers",
                &self
                    .consumers
                    .iter()
                    .map(|c| &c.cfg.name)
                    .collect::<Vec<_>>(),
            )
            .field("database", &self.database.is_some())
            .finish_non_exhaustive()
    }
}

impl Harness {
    /// An empty harness whose clock reads 2030-01-01T00:00:00Z until advanced.
    pub fn new() -> Self {
        Harness {
            now: DateTime::from_timestamp(1_893_456_000, 0).unwrap_or_default(),
            outbox: Vec::new(),
            inbox: Vec::new(),
            next_inbox_id: 1,
            consumers: Vec::new(),
            events: None,
            database: None,
        }
    }

    /// A harness whose deliveries have a database: every attempt runs in a transaction of its
    /// own on a connection from `pool`, lent to the handler through its [`Delivery`] as the
    /// runtime lends it, so [`Delivery::conn`], [`Delivery::shared_conn`],
    /// [`Delivery::enqueue`] and [`DeliveryBatch::conn`] work. The transaction commits when
    /// the handler returns `Ok` and the row is marked PROCESSED; it rolls back when the
    /// attempt fails, and always on [`Harness::redeliver`] (a crash before the commit). The
    /// clock, the order of deliveries, pause and the inbox and outbox stay in memory as in
    /// [`Harness::new`]: the database holds only what handlers write.
    ///
    /// An attempt fails, rolled back, rather than commit something the runtime would not: a
    /// handler that keeps the connection past its return, leaves a transaction of its own
    /// open, ends the delivery's transaction itself (`COMMIT` by hand), or returns `Ok` from a
    /// transaction a failed statement has aborted. When the harness cannot open the
    /// transaction (the pool times out), the attempt fails with the pool's error code,
    /// without its handler.
    ///
    /// The database needs the library's migrations ([`migrate`](crate::migrate)) when a
    /// handler enqueues follow-ups: they land in its `outbox_events`, not in the harness's
    /// outbox, so they are not published to the harness's consumers. Give the pool a
    /// connection more than handlers take of their own while they run: the attempt holds
    /// one. See [`Harness::check_redelivery`] for the check this makes possible, and the
    /// [`testing`](crate::testing) module for an example.
    pub fn with_database(pool: PgPool) -> Self {
        Harness {
            database: Some(pool),
            ..Harness::new()
        }
    }

    /// The manual clock: the `now()` of every state transition.
    pub fn now(&self) -> DateTime<Utc> {
        self.now
    }

    /// Moves the clock forward by `by`. Nothing runs; the next [`Harness::deliver`] sees the
    /// rows that have fallen due.
    pub fn advance(&mut self, by: Duration) {
        let by = TimeDelta::from_std(by).unwrap_or(TimeDelta::MAX);
        self.now = self
            .now
            .checked_add_signed(by)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
    }

    /// Gives the harness the application's event types, as
    /// [`OutboxBuilder::events`](crate::OutboxBuilder::events) does: deliveries of an older
    /// version are upcast before the handler sees them, an unreadable version is dead-lettered.
    pub fn events(&mut self, registry: EventRegistry) -> &mut Self {
        let registry = Arc::new(registry);
        for slot in &mut self.consumers {
            slot.cfg.events = Some(registry.clone());
        }
        self.events = Some(registry);
        self
    }

    /// Registers a consumer as [`OutboxBuilder::consumer`](crate::OutboxBuilder::consumer)
    /// does: its subscriptions take effect for events published from now on, and `make` builds
    /// its handler actor now and again whenever that actor has stopped.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid configuration or a name registered twice.
    pub fn consumer<A, F>(&mut self, config: ConsumerConfig, make: F) -> Result<&mut Self>
    where
        A: Actor<Context = Context<A>> + Handler<Delivery>,
        F: Fn() -> A + 'static,
    {
        self.register(
            config,
            Box::new(move || HandlerRef::One(make().start().recipient())),
        )
    }

    /// Registers a batch consumer as
    /// [`OutboxBuilder::batch_consumer`](crate::OutboxBuilder::batch_consumer) does. The
    /// harness hands rows over one at a time, so each [`DeliveryBatch`] holds one event: what
    /// the runtime does when it replays a failed batch to find the failing event.
    ///
    /// # Errors
    /// As [`Harness::consumer`].
    pub fn batch_consumer<A, F>(&mut self, config: ConsumerConfig, make: F) -> Result<&mut Self>
    where
        A: Actor<Context = Context<A>> + Handler<DeliveryBatch>,
        F: Fn() -> A + 'static,
    {
        self.register(
            config,
            Box::new(move || HandlerRef::Batch(make().start().recipient())),
        )
    }

    fn register(&mut self, config: ConsumerConfig, factory: Factory) -> Result<&mut Self> {
        config.validate()?;
        if self.slot(config.name.as_str()).is_some() {
            return Err(Error::Config(format!(
                "consumer {} registered twice",
                config.name
            )));
        }
        let mut cfg = config;
        cfg.events = self.events.clone();
        let handler = factory();
        self.consumers.push(ConsumerSlot {
            cfg,
            factory,
            handler,
            paused: false,
            restarts: 0,
            duplicates: 0,
            versions: HashMap::new(),
        });
        Ok(self)
    }

    /// Writes an event to the outbox as [`enqueue`](crate::enqueue) does, with the same checks.
    ///
    /// # Errors
    /// [`Error::InvalidEvent`] for a malformed event; [`Error::Database`] (a unique violation)
    /// when an event with the same id is already in the outbox.
    pub fn enqueue(&mut self, event: &NewEvent) -> Result<EventId> {
        self.enqueue_many(std::slice::from_ref(event))
            .map(|ids| ids[0])
    }

    /// Writes several events as [`enqueue_many`](crate::enqueue_many) does: all or none.
    ///
    /// # Errors
    /// As [`Harness::enqueue`].
    pub fn enqueue_many(&mut self, events: &[NewEvent]) -> Result<Vec<EventId>> {
        let rules = PayloadRules::default();
        for (i, event) in events.iter().enumerate() {
            event.validate(&rules)?;
            let seen_before = events[..i].iter().any(|e| e.id == event.id)
                || self.outbox.iter().any(|o| o.event.id == event.id);
            if seen_before {
                return Err(unique_violation(format!(
                    "duplicate key value violates unique constraint \"outbox_events_pkey\": {}",
                    event.id
                )));
            }
        }
        for event in events {
            self.outbox.push(OutboxEntry {
                // An event that starts a chain is its own correlation root.
                correlation_id: event
                    .correlation_id
                    .clone()
                    .unwrap_or_else(|| event.id.to_string()),
                event: event.clone(),
                created_at: self.now,
                status: OutboxStatus::Pending,
                attempts: 0,
                published_at: None,
            });
        }
        Ok(events.iter().map(|e| e.id).collect())
    }

    /// One publisher cycle (`claim_and_fan_out`): every PENDING outbox row, in enqueue order,
    /// becomes PUBLISHED and gets one RECEIVED inbox row per consumer subscribed to its type.
    /// A consumer that already has the event keeps its row; the duplicate is counted.
    ///
    /// Returns the number of outbox rows published.
    pub fn publish(&mut self) -> usize {
        let mut subscribers: Vec<usize> = (0..self.consumers.len()).collect();
        // The fan-out inserts in (seq, consumer) order; the inbox ids, and so claim order, follow.
        subscribers.sort_by(|a, b| {
            self.consumers[*a]
                .cfg
                .name
                .cmp(&self.consumers[*b].cfg.name)
        });
        let mut published = 0;
        for o in 0..self.outbox.len() {
            if self.outbox[o].status != OutboxStatus::Pending {
                continue;
            }
            published += 1;
            let entry = &mut self.outbox[o];
            entry.status = OutboxStatus::Published;
            entry.attempts += 1;
            entry.published_at = Some(self.now);
            for &c in &subscribers {
                let entry = &self.outbox[o];
                let slot = &self.consumers[c];
                if !slot.cfg.event_types.contains(&entry.event.event_type) {
                    continue;
                }
                let exists = self.inbox.iter().any(|i| {
                    i.row.event_id == entry.event.id.as_uuid() && i.consumer == slot.cfg.name
                });
                if exists {
                    self.consumers[c].duplicates += 1;
                    continue;
                }
                let e = &entry.event;
                let row = InboxRow {
                    id: self.next_inbox_id,
                    event_id: e.id.as_uuid(),
                    event_type: e.event_type.clone(),
                    event_version: e.event_version,
                    aggregate_type: e.aggregate_type.clone(),
                    aggregate_id: e.aggregate_id.clone(),
                    aggregate_version: e.aggregate_version,
                    payload: e.payload.clone(),
                    metadata: e.metadata.clone(),
                    correlation_id: entry.correlation_id.clone(),
                    causation_id: e.causation_id.clone(),
                    event_created_at: entry.created_at,
                    attempt_count: 0,
                    lease_token: 0,
                    alone: false,
                    backend: 0,
                };
                self.next_inbox_id += 1;
                self.inbox.push(InboxEntry {
                    row,
                    consumer: slot.cfg.name.clone(),
                    status: InboxStatus::Received,
                    next_attempt_at: self.now,
                    error_code: None,
                    last_error: None,
                });
            }
        }
        published
    }

    /// Puts a published event back to PENDING, as an expired lease or a lost acknowledgement
    /// does; the next [`Harness::publish`] fans it out again and the inboxes absorb it.
    /// Returns false when the outbox has no such event.
    pub fn republish(&mut self, event_id: EventId) -> bool {
        match self.outbox.iter_mut().find(|o| o.event.id == event_id) {
            Some(o) => {
                o.status = OutboxStatus::Pending;
                true
            }
            None => false,
        }
    }

    /// One delivery cycle: for each consumer that is not paused, in registration order, every
    /// inbox row due by the clock (RECEIVED or RETRY_PENDING with `next_attempt_at <= now`),
    /// in claim order (`next_attempt_at`, then arrival), is delivered once and marked.
    ///
    /// A row that fails with a zero delay is due again at once, but in the next cycle: each
    /// cycle delivers what was due when it began.
    pub async fn deliver(&mut self) -> Vec<Outcome> {
        let mut out = Vec::new();
        for c in 0..self.consumers.len() {
            if self.consumers[c].paused {
                continue;
            }
            let due = self.due_rows(c);
            self.run_cycle(c, due, &mut out).await;
        }
        out
    }

    /// A delivery cycle of one consumer restricted to `order`, delivered in exactly that order:
    /// what concurrent instances or a retried predecessor make happen in production. An event
    /// whose row a claim would not return now (not due, already finished, consumer paused, no
    /// row) is not delivered and gets no [`Outcome`].
    pub async fn deliver_out_of_order(
        &mut self,
        consumer: &str,
        order: &[EventId],
    ) -> Vec<Outcome> {
        let mut out = Vec::new();
        let Some(c) = self.slot(consumer) else {
            return out;
        };
        if self.consumers[c].paused {
            return out;
        }
        let due = self.due_rows(c);
        let mut rows = Vec::new();
        for id in order {
            if let Some(&i) = due
                .iter()
                .find(|&&i| self.inbox[i].row.event_id == id.as_uuid())
            {
                if !rows.contains(&i) {
                    rows.push(i);
                }
            }
        }
        self.run_cycle(c, rows, &mut out).await;
        out
    }

    /// Delivers an event again as a failed commit (a connection lost after the handler
    /// returned) or a crash does: the handler runs on the row as it stands, and the attempt's
    /// transaction rolls back, so the row keeps its state and attempt count and the next cycle
    /// delivers the same attempt again. With a database ([`Harness::with_database`]) the
    /// handler's writes through its delivery roll back with it, whatever it returned.
    ///
    /// Returns `None`, counting a duplicate, when the row is already PROCESSED or DEAD_LETTER:
    /// the inbox never hands a finished row out again. Returns `None` as well when the consumer
    /// has no row for the event.
    pub async fn redeliver(&mut self, event_id: EventId, consumer: &str) -> Option<Outcome> {
        let c = self.slot(consumer)?;
        let i = self.row_index(c, event_id)?;
        if !self.inbox[i].status.claimable() {
            self.consumers[c].duplicates += 1;
            return None;
        }
        self.ensure_handler(c);
        Some(self.attempt(c, i, false).await)
    }

    /// Publishes and delivers, moving the clock to each next retry, until nothing is pending
    /// or due for any consumer that is not paused. Returns every delivery made.
    ///
    /// Ends because each row gets at most its policy's `max_attempts`; a policy with a huge
    /// limit and a handler that always fails makes it run that long.
    pub async fn run_until_idle(&mut self) -> Vec<Outcome> {
        let mut out = Vec::new();
        loop {
            self.publish();
            out.extend(self.deliver().await);
            match self.next_due() {
                Some(at) if at > self.now => self.now = at,
                Some(_) => {}
                None => return out,
            }
        }
    }

    /// When the next row of a consumer that is not paused falls due (now, if one is due), or
    /// when a pending outbox row waits for [`Harness::publish`]. `None` when nothing waits.
    pub fn next_due(&self) -> Option<DateTime<Utc>> {
        let pending = self
            .outbox
            .iter()
            .any(|o| o.status == OutboxStatus::Pending)
            .then_some(self.now);
        let inbox = self
            .inbox
            .iter()
            .filter(|i| i.status.claimable())
            .filter(|i| {
                self.consumers
                    .iter()
                    .any(|c| c.cfg.name == i.consumer && !c.paused)
            })
            .map(|i| i.next_attempt_at)
            .min();
        match (pending, inbox) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
