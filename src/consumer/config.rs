//! [`ConsumerConfig`]: how one consumer is run.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::event::redact::Redactor;
use crate::event::{ConsumerName, EventRegistry};
use crate::retry::RetryPolicy;

/// How one consumer is run. Build with [`ConsumerConfig::new`] and the setters.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub(crate) name: ConsumerName,
    pub(crate) event_types: Vec<String>,
    /// The types of `event_types` subscribed in the HIGH lane.
    pub(crate) high: Vec<String>,
    pub(crate) retry: RetryPolicy,
    pub(crate) batch_size: u32,
    pub(crate) concurrency: u32,
    pub(crate) pipeline: u32,
    pub(crate) mailbox_capacity: usize,
    pub(crate) handler_timeout: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) skip_stale: bool,
    pub(crate) ordered: bool,
    pub(crate) skip_dead_letters: bool,
    pub(crate) replay_safe: bool,
    pub(crate) cursor: bool,
    pub(crate) rate_limit: Option<f64>,
    pub(crate) lease: Option<Duration>,
    pub(crate) threads: Option<u32>,
    pub(crate) thread_group: Option<String>,
    pub(crate) allowed_delay: Option<Duration>,
    pub(crate) critical_multiple: u32,
    /// Set by the builder from [`OutboxBuilder::events`](crate::OutboxBuilder::events).
    pub(crate) events: Option<Arc<EventRegistry>>,
    /// Set by the builder from [`RuntimeConfig::redact_errors`](crate::RuntimeConfig::redact_errors):
    /// what of a handler's error message is stored and logged.
    pub(crate) redact: Redactor,
    /// This consumer's batches in this process, counted: which source and lane a batch reads
    /// first (shared by the clones the runtime makes).
    pub(crate) turn: Arc<AtomicUsize>,
    /// Set at start when the consumer's cursor is turned off while it still has cursors: it
    /// reads them until it drops them (the migration `cursor_off`).
    pub(crate) retiring: Arc<AtomicBool>,
}

impl ConsumerConfig {
    /// A consumer called `name` with the defaults: [`RetryPolicy::default`], batches of 32
    /// rows per transaction, one batch at a time, a mailbox of 64, a 30 s handler timeout and
    /// a 1 s poll for rows the mailbox never announced.
    ///
    /// The name is checked with every other setting, when the runtime starts
    /// ([`Error::Config`] for a name that is not 1–100 characters of `[A-Za-z0-9_.-]`), so
    /// that building a configuration never fails half-way through its setters.
    pub fn new(name: &str) -> Self {
        ConsumerConfig {
            name: ConsumerName::unchecked(name),
            event_types: Vec::new(),
            high: Vec::new(),
            retry: RetryPolicy::default(),
            batch_size: 32,
            concurrency: 1,
            pipeline: 1,
            mailbox_capacity: 64,
            handler_timeout: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            skip_stale: false,
            ordered: false,
            skip_dead_letters: false,
            replay_safe: false,
            cursor: false,
            allowed_delay: None,
            critical_multiple: 3,
            rate_limit: None,
            lease: None,
            threads: None,
            thread_group: None,
            events: None,
            redact: Redactor::default(),
            turn: Arc::default(),
            retiring: Arc::default(),
        }
    }
    /// Subscribes to an event type.
    pub fn subscribe(mut self, event_type: &str) -> Self {
        if !self.event_types.iter().any(|t| t == event_type) {
            self.event_types.push(event_type.to_owned());
        }
        self
    }
    /// Subscribes to an event type in the HIGH lane (needs [`cursor`](ConsumerConfig::cursor)):
    /// this consumer reads the events of its HIGH types before its other events, so a backlog
    /// of the others does not hold them up, and gives the others one claim in five, so they
    /// are never starved. A HIGH consumer is one that subscribes to every type this way.
    ///
    /// The lane belongs to the event: it is stamped HIGH only when every cursor consumer of
    /// its type subscribes to it as HIGH (a consumer reading the type LOW keeps it LOW for
    /// all, and the start records the contract finding `HIGH_LANE_OVERRULED` naming it, a
    /// warning unless the contract check is off). Lanes order events across types: an
    /// aggregate with events of a HIGH and a LOW type can be applied out of order (as it can
    /// for any consumer while a type's lane changes), so `skip_stale` with both lanes, which
    /// would skip the older event every time, is refused (`CONFIG_INVALID`). Within a lane,
    /// events keep their order. The publisher still publishes in commit order. See
    /// `docs/storage-v2.md#priority-lanes`.
    pub fn subscribe_high(mut self, event_type: &str) -> Self {
        self = self.subscribe(event_type);
        if !self.high.iter().any(|t| t == event_type) {
            self.high.push(event_type.to_owned());
        }
        self
    }
    /// The retry policy for this consumer only.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }
    /// Inbox rows claimed per transaction: for a [`Delivery`](super::Delivery) handler, each handled in one
    /// call; for a [`DeliveryBatch`](super::DeliveryBatch) handler, the most one call gets.
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch_size = n;
        self
    }
    /// Batches in flight at once, each on its own connection. Extra batches start only for a
    /// backlog (a batch came back full); rows that trickle in while a batch runs wait for that
    /// loop's next batch and share its transaction, which is cheaper than a transaction each.
    /// For slow handlers (a remote call per row) that should run side by side, keep
    /// `batch_size` small so that batches fill.
    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = n;
        self
    }
    /// How many deliveries of a batch a [`Delivery`](super::Delivery) handler gets at once, in
    /// the batch's one transaction. Handlers that write through
    /// [`Delivery::shared_conn`](super::Delivery::shared_conn) then have their statements
    /// *pipelined*: sent together, run back to back, one wait for all of them instead of one
    /// per event. The deliveries of one aggregate are never handed over together: each waits
    /// for the one before it, so an aggregate's events are still handled in claim order. A
    /// failure handles the batch again one delivery at a time (as after a failure without
    /// pipelining), so that it is charged to the event that caused it. A timeout applies to
    /// the deliveries handed over together, as one call. Default 1 (one at a time); a batch
    /// handler ignores it.
    pub fn pipeline(mut self, n: u32) -> Self {
        self.pipeline = n;
        self
    }
    /// Capacity of the consumer's wake-up mailbox.
    pub fn mailbox_capacity(mut self, n: usize) -> Self {
        self.mailbox_capacity = n;
        self
    }
    /// How long one handler call may take before it counts as a failure (for a batch consumer,
    /// one call handles a whole batch).
    pub fn handler_timeout(mut self, d: Duration) -> Self {
        self.handler_timeout = d;
        self
    }
    /// How long a claimed batch is reserved for the loop that claimed it. A batch stops
    /// handing rows over in time to settle within it; a lease that expires is one whose loop
    /// died (its process, its database session or its connection), and the consumer's reaper
    /// then settles its rows (see the module docs of `consumer` for who is charged). Longer
    /// means fewer rows per batch never at risk, shorter means a death is noticed sooner.
    /// Default: twice the handler timeout, at least 10 s. At least twice the handler timeout.
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = Some(d);
        self
    }
    /// The lease in force: [`ConsumerConfig::lease`] or its default.
    pub(crate) fn lease_period(&self) -> Duration {
        self.lease.unwrap_or_else(|| {
            (self.handler_timeout.saturating_mul(2)).max(Duration::from_secs(10))
        })
    }
    /// How many threads this consumer's handler actors run on: one actor per thread, each made
    /// by the consumer's factory on its thread. Each batch loop is given the actor whose
    /// thread the fewest loops use, so with `threads ≥ concurrency` every loop has a thread of
    /// its own; a thread whose handler overran its timeout and still runs is given to a loop
    /// only when every thread is in that state.
    ///
    /// Handlers never run on the runtime's own thread: a handler that blocks its thread (a
    /// synchronous client, a parser, `std::thread::sleep`) delays only the calls on the same
    /// thread, never the publisher, the reapers, the other consumers or the operator API.
    /// Default: [`concurrency`](ConsumerConfig::concurrency), a thread per batch loop. Fewer
    /// suit handlers that never block (they interleave on one thread); with a blocking handler,
    /// a call that waits behind another loop's on the same thread spends its
    /// `handler_timeout` waiting.
    ///
    /// `threads(0)` runs the handler on the runtime's own thread, as earlier versions did: no
    /// call crosses a thread, which a drain of one event per call measured at about a fifth
    /// faster (`docs/performance.md`), but a handler that blocks then stops the whole runtime.
    /// Only for handlers that never block.
    pub fn threads(mut self, n: u32) -> Self {
        self.threads = Some(n);
        self
    }
    /// The handler threads in force: [`ConsumerConfig::threads`] or its default.
    pub(crate) fn thread_count(&self) -> u32 {
        self.threads.unwrap_or(self.concurrency)
    }
    /// Runs this consumer's handlers on the threads of `group`, shared with every consumer that
    /// names the same group (in this runtime). The group has as many threads as the largest
    /// [`threads`](ConsumerConfig::threads) (or default) among its consumers. For many light consumers that
    /// need not each have a thread. Default: a group of the consumer's own.
    pub fn thread_group(mut self, group: &str) -> Self {
        self.thread_group = Some(group.to_owned());
        self
    }
    /// The thread group the consumer's handlers run in.
    pub(crate) fn group(&self) -> String {
        match &self.thread_group {
            Some(g) => format!("group:{g}"),
            None => format!("consumer:{}", self.name),
        }
    }
    /// How often the inbox is polled without a wake-up.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }
    /// Handles at most `per_second` events per second on this instance (split evenly over the
    /// concurrent batches), so that a backlog drains without a storm on what the handler calls.
    /// Default: unlimited.
    pub fn rate_limit(mut self, per_second: f64) -> Self {
        self.rate_limit = Some(per_second);
        self
    }
    /// Stale-event detection: per aggregate, the last applied aggregate version is recorded in
    /// the delivery's transaction, and an event whose aggregate version is below it is
    /// recorded as PROCESSED with `EVENT_STALE` without calling the handler. An event at the
    /// same version is applied: the events one change emits share its version. For consumers
    /// that project state (a late `SENT` must not overwrite `DELIVERED`); leave it off for
    /// consumers that must see every event, such as counters. Default off.
    pub fn skip_stale(mut self, on: bool) -> Self {
        self.skip_stale = on;
        self
    }
    /// Ordered per aggregate, parallel across aggregates: an aggregate's events are applied in
    /// the order they were enqueued, and its next event is never handed over before the one
    /// before it is processed, dead-lettered (see [`ConsumerConfig::skip_dead_letters`]) or
    /// ignored — across batch loops and across instances, since the rule is the claim's: a
    /// row is claimed only when it is the earliest unfinished event of its aggregate. Events
    /// of different aggregates still run side by side, and a failing event holds up only its
    /// own aggregate while it waits for its retry. Default off.
    ///
    /// The order is the order in which the events were enqueued (the outbox's sequence); for
    /// events of one aggregate that is the order of their transactions when each locks the
    /// aggregate's row, as an update of it does. Events received from a broker
    /// ([`receive`](crate::transport::receive)) are not ordered here. Turning it on orders
    /// the events fanned out from then on.
    ///
    /// What it costs: a claim reads past the rows held up behind a failing event, and an
    /// aggregate with a backlog moves one event per claim. See the README's performance notes.
    pub fn ordered(mut self, on: bool) -> Self {
        self.ordered = on;
        self
    }
    /// For an [`ordered`](ConsumerConfig::ordered) consumer, whether a dead-lettered event lets
    /// the events of its aggregate behind it go on. Default off: a dead letter holds its
    /// aggregate until an operator retries or ignores it, since the events behind it were
    /// written assuming it had been applied.
    pub fn skip_dead_letters(mut self, on: bool) -> Self {
        self.skip_dead_letters = on;
        self
    }
    /// **Experimental** (storage v2, first step): read events through a cursor instead of an
    /// inbox row per event. The publisher lists the events it publishes in stamps numbered in
    /// commit order; the consumer's batch reads past its cursor and moves it in the commit that
    /// holds the handlers' effects. An event gets an inbox row only for an exception (a failure,
    /// a row given back, a death, a hung handler), which then follows the inbox's rules. So a
    /// delivered event costs no inbox row at all. Default off.
    ///
    /// Not yet with [`ordered`](ConsumerConfig::ordered) ([`Error::Config`]). A replay
    /// ([`ops::replay`](crate::ops::replay)) re-applies what it read through its cursors while
    /// the outbox keeps those events, then its inbox rows. Events are spread
    /// over 8 slots by aggregate, each with its own cursor, so up to 8 batches of the consumer
    /// read at once (`concurrency`); HIGH events ([`subscribe_high`](Self::subscribe_high))
    /// over 8 more. Only events published by this
    /// database's in-process publisher are read through the cursor; events received from a
    /// broker still get inbox rows. The inbox list and the stats show a cursor consumer's
    /// exceptions, not the events it processed; the event view (`GET /events/{id}`) and the
    /// correlation timeline read its status from the cursor. Turned off again, the consumer's
    /// new events get inbox rows from its next start, and it reads what waits past its
    /// cursors until it can drop them: once every transaction of the database open at that
    /// start has ended and nothing of its own is left past them. `ordered` is refused
    /// ([`Error::Config`]) until they are dropped. See `docs/storage-v2.md`.
    pub fn cursor(mut self, on: bool) -> Self {
        self.cursor = on;
        self
    }
    /// Whether an operator may replay events this consumer already processed
    /// ([`ops::replay`](crate::ops::replay)). Default off: a replay hands the handler an event
    /// whose effect it already wrote, which only a handler written for it takes well (one that
    /// rebuilds a projection with upserts, say). The handler sees
    /// [`DeliveryMode::Replay`](super::DeliveryMode::Replay) for those deliveries.
    pub fn replay_safe(mut self, on: bool) -> Self {
        self.replay_safe = on;
        self
    }
    /// How long an event may wait for this consumer, from its creation to its processing: the
    /// consumer's service level. Health says `CONSUMER_LATE` (WARNING) for it, by name, while
    /// one of its events has waited longer, and CRITICAL past
    /// [`allowed_delay_critical`](Self::allowed_delay_critical) times it, instead of judging it
    /// by the global inbox thresholds; `inbox_processed_within_allowed_delay_total{consumer}`
    /// over `inbox_processed_total{consumer}` is the share delivered within it. Default: none.
    pub fn allowed_delay(mut self, delay: Duration) -> Self {
        self.allowed_delay = Some(delay);
        self
    }
    /// How many times its [`allowed_delay`](Self::allowed_delay) an event may wait before
    /// health turns CRITICAL for the consumer. Default 3.
    pub fn allowed_delay_critical(mut self, multiple: u32) -> Self {
        self.critical_multiple = multiple;
        self
    }
    /// The allowed delay and the critical one, in milliseconds, as registered.
    pub(crate) fn delay_levels(&self) -> Option<(i64, i64)> {
        let allowed = self.allowed_delay?;
        let critical = allowed.saturating_mul(self.critical_multiple);
        Some((
            crate::store::millis(allowed),
            crate::store::millis(critical),
        ))
    }
    /// The consumer's name.
    pub fn name(&self) -> &ConsumerName {
        &self.name
    }

    /// Whether its batches read cursors: it reads through them, or is turning them off.
    pub(crate) fn reads_cursor(&self) -> bool {
        self.cursor || self.retiring.load(Ordering::Relaxed)
    }

    pub(crate) fn validate(&self) -> crate::Result<()> {
        ConsumerName::new(self.name.as_str())?;
        let bad = |why: &str| Err(Error::Config(format!("consumer {}: {why}", self.name)));
        if self.event_types.is_empty() {
            return bad("subscribes to no event type");
        }
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return bad("batch_size must be within 1..=10000");
        }
        if self.concurrency == 0 || self.concurrency > 256 {
            return bad("concurrency must be within 1..=256");
        }
        if self.pipeline == 0 || self.pipeline > 10_000 {
            return bad("pipeline must be within 1..=10000");
        }
        if self.threads.is_some_and(|n| n > 256) {
            return bad("threads must be within 0..=256");
        }
        if self
            .thread_group
            .as_ref()
            .is_some_and(|g| g.is_empty() || g.len() > 100)
        {
            return bad("thread_group must be 1..=100 bytes");
        }
        if !self.high.is_empty() && !self.cursor {
            return bad("subscribe_high needs cursor(true): lanes are read through a cursor");
        }
        if self.skip_stale
            && !self.high.is_empty()
            && self.event_types.iter().any(|t| !self.high.contains(t))
        {
            return bad(
                "skip_stale with HIGH and LOW types: lanes can apply an aggregate's older \
                 LOW event after a newer HIGH one, and skip_stale would skip it",
            );
        }
        if self.cursor && self.ordered {
            return bad("cursor delivery does not support ordered yet");
        }
        if self.mailbox_capacity == 0 {
            return bad("mailbox_capacity must be at least 1");
        }
        if self.rate_limit.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
            return bad("rate_limit must be a positive number of events per second");
        }
        if self.allowed_delay.is_some_and(|d| d.is_zero()) || self.critical_multiple == 0 {
            return bad("allowed_delay must be positive, and its critical multiple at least 1");
        }
        if self.handler_timeout.is_zero() || self.poll_interval.is_zero() {
            return bad("handler_timeout and poll_interval must be positive");
        }
        if self.lease_period() < self.handler_timeout.saturating_mul(2) {
            return bad("lease must be at least twice handler_timeout");
        }
        self.retry.validate()
    }
}
