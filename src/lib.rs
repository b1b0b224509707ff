//! # actix-outbox
//!
//! Reliable event delivery for actix-web applications on PostgreSQL: the transactional
//! outbox and inbox, run by supervised actix actors.
//!
//! ## Overview
//!
//! A business change and the event it causes are written in **one** PostgreSQL transaction
//! ([`enqueue`] takes the caller's connection; [`enqueue_with`] writes a single business
//! statement and its events as one SQL statement). A `PublisherActor` claims committed events and,
//! in the same statement, writes one inbox row per subscribed consumer. Each consumer is an
//! actix actor handling [`Delivery`] messages (or [`DeliveryBatch`]es, several events per call,
//! for effects written in one statement); the delivery carries the open inbox transaction, so
//! the consumer's effect and the inbox's PROCESSED mark commit together.
//!
//! ## Guarantees
//!
//! - **No lost events.** An event exists if and only if the business transaction committed.
//!   Once committed it is delivered to every consumer subscribed when it is published, whatever
//!   dies in between (process, connection, actor): the database holds every piece of state.
//! - **At-least-once delivery, effectively-once effects.** A consumer can see an event more than
//!   once — after a crash mid-handler, a rollback, a timeout — but the effect it writes through
//!   [`Delivery::conn`] commits at most once, because it commits with the inbox mark and the
//!   inbox row is unique per (event, consumer). Effects outside that transaction (an HTTP call)
//!   are *not* covered by the inbox: record them as [`effects`] in that transaction, and a
//!   worker of the runtime makes each call at least once, with an idempotency key for the
//!   provider.
//! - **Isolation.** Consumers have their own inbox rows, retry policy and failures: one
//!   failing consumer neither blocks nor repeats another.
//! - **No poison loop.** An attempt that never finished because its handler killed the process
//!   is still counted (`INBOX_ATTEMPT_INTERRUPTED`), so such an event is dead-lettered after
//!   its attempts instead of killing every restart.
//! - **Order per aggregate only where asked**: `ConsumerConfig::ordered(true)` applies one
//!   aggregate's events in enqueue order (events received from a broker are never ordered);
//!   other consumers compare aggregate versions (`skip_stale`).
//!
//! ## Quick start
//!
//! The shape of an application; `examples/quickstart.rs` (the README's quick start) is the
//! same as a whole program that runs against an empty database and waits until its event is
//! delivered before it shuts down.
//!
//! ```no_run
//! use actix::prelude::*;
//! use actix_outbox::{enqueue, ConsumerConfig, Delivery, HandlerError, NewEvent, OutboxRuntime};
//! use diesel_async::{AsyncConnection, RunQueryDsl};
//!
//! struct Notifier;
//! impl Actor for Notifier {
//!     type Context = Context<Self>;
//! }
//! impl Handler<Delivery> for Notifier {
//!     type Result = ResponseFuture<Result<(), HandlerError>>;
//!     fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
//!         Box::pin(async move {
//!             let mut conn = d.conn().await?;
//!             // `Prepared`: a constant statement is prepared once per connection.
//!             actix_outbox::db::Prepared(
//!                 diesel::sql_query("INSERT INTO notifications (order_id) VALUES ($1)")
//!                     .bind::<diesel::sql_types::Text, _>(d.aggregate_id()),
//!             )
//!             .execute(&mut *conn)
//!             .await?;
//!             Ok(())
//!         })
//!     }
//! }
//!
//! # async fn run() -> actix_outbox::Result<()> {
//! let url = "postgres://localhost/app";
//! actix_outbox::migrate(url).await?;
//! let pool = actix_outbox::connect(url, 10).await?;
//! let runtime = OutboxRuntime::builder(actix_outbox::connect(url, 8).await?)
//!     .consumer(ConsumerConfig::new("notification").subscribe("ORDER_COMPLETED"), || Notifier)
//!     .start()
//!     .await?;
//! let outbox = runtime.handle();
//!
//! // In a request handler: the business change and the event, one transaction.
//! let mut conn = pool.get().await?;
//! conn.transaction::<_, actix_outbox::Error, _>(async |conn| {
//!     diesel::sql_query("UPDATE orders SET status = 'COMPLETED' WHERE id = 'o1'")
//!         .execute(conn)
//!         .await?;
//!     enqueue(conn, &NewEvent::new("ORDER_COMPLETED", "order", "o1", serde_json::json!({}))).await?;
//!     Ok(())
//! })
//! .await?;
//! outbox.wake(); // deliver now rather than at the next poll
//! // … and at the application's end: in-flight batches finish, nothing new is claimed.
//! runtime.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! ## Concepts
//!
//! - **Outbox row** (`outbox_events`): `PENDING → PUBLISHED`. The in-process publisher claims,
//!   fans out and marks in one statement, so a row is never stuck half-way.
//! - **Inbox row** (`inbox_events`), one per (event, consumer): `RECEIVED → PROCESSED`, or
//!   `RETRY_PENDING` after a failure (backoff from the consumer's [`RetryPolicy`]) and
//!   `DEAD_LETTER` once attempts run out or on a [`HandlerError::Permanent`].
//! - **Mailboxes are a fast path.** The publisher and the consumers also poll; a lost message
//!   costs latency only.
//! - **Supervision.** The supervisor rebuilds any actor that stopped or panicked. A panic in a
//!   consumer's handler fails that delivery (retried like an error); if it killed the handler
//!   actor (a panic in `handle` itself, not in the future it returns), the actor is rebuilt
//!   from its factory.
//! - **Pools.** Give the runtime a pool of its own, created outside the actix-web workers:
//!   a diesel-async connection runs its I/O on the runtime that opened it, and actix-web stops
//!   its workers before the outbox runtime has drained.
//! - **Several processes** may run the runtime on one database: claims use `SKIP LOCKED`, and
//!   subscriptions live in the database, so any instance fans out to every consumer.
//!
//! ## Architecture
//!
//! One folder per responsibility, in layers. A module uses the layers below it and never a
//! layer above; the modules of one layer do not use each other. `src/layers.rs` checks this on
//! every test run, so an import that breaks the order fails CI.
//!
//! ```text
//! 7  admin/ (operator API, dashboard, Prometheus)    testing/ (harness, fault scripts)
//! 6  runtime/    builder, supervisor, LISTEN, start-up and shutdown
//! 5  nats/       the JetStream bridge (feature `nats`): a transport and a supervised receiver
//! 4  consumer/   publisher/   reconciler/   maintenance/      (actors; independent)
//! 3  outbox/ (enqueue)        inbox/ (keys, pause, receive)
//! 2  store/      the SQL of the state machines, connections, migrations
//! 1  event/      messages      retry      telemetry/
//! 0  error       the error enum and its stable codes
//! ```
//!
//! - `event/`: ids, the envelope, typed [`Event`]s, the [`EventRegistry`], [`OutboxEvent`](event::OutboxEvent),
//!   and the redaction of error text before it is stored ([`redact`]).
//! - `messages`: what actors say to each other (wake, drain, stop, "inbox rows written") and
//!   the `NOTIFY` channels between instances; an actor depends on the messages it handles,
//!   never on the actor at the other end.
//! - `retry`: [`RetryPolicy`], shared by consumers and external transports. `telemetry/`: the
//!   metric hooks of the hot paths.
//! - `consumer/`: the delivery message, handler errors and the consumer engine (its module
//!   docs say how leases and death accounting work). `publisher/`: the claim loop and external
//!   transports. `reconciler/`: rules and drift checks. `maintenance/`: the stats sampler, lag
//!   health ([`HealthReport`](health::HealthReport)) and retention.
//!
//! ## Features
//!
//! - `testing`: the harness and fault injection below.
//! - `admin` (default): [`admin_scope`](admin::admin_scope), the operator API with its dashboard, health and
//!   Prometheus endpoint; adds actix-web and metrics-exporter-prometheus.
//! - `nats`: the NATS JetStream bridge ([`nats`]): `NatsTransport` publishes outbox events to a
//!   stream, `NatsReceiver` records a durable consumer's messages in this database's inbox;
//!   adds async-nats.
//! - `otel`: OpenTelemetry across the outbox. At enqueue the current span's context is stored
//!   in the event's metadata as W3C `traceparent` / `tracestate` (and travels as NATS headers);
//!   each delivery runs in a span `outbox.deliver` ([`Delivery::span`]) whose parent is that
//!   context, with the event's ids as fields; [`Delivery::enqueue`] gives a follow-up the
//!   delivery's span as its parent. Install `tracing-opentelemetry`'s layer to export them;
//!   adds opentelemetry (API only) and tracing-opentelemetry.

//!
//! ## Testing your consumers
//!
//! - Handlers that only decide (no database): [`testing::Harness`] runs your real actor through
//!   publish and delivery cycles with a manual clock — retries fire when you advance it — and
//!   lets you pause consumers, deliver out of order or twice, and inspect each inbox row.
//! - Handlers that write through [`Delivery::conn`]: the same harness built with
//!   [`testing::Harness::with_database`] runs each attempt in a real transaction on your test
//!   database (committed when it succeeds, rolled back when it fails or crashes); count the
//!   effect rows. [`testing::Harness::check_redelivery`] crashes each delivery before its
//!   commit and delivers it again, and reports the consumers whose effects the crash repeats
//!   (they write outside the delivery's transaction).
//! - The runtime itself, against PostgreSQL (one database per test), for what the harness does
//!   not model (concurrency, batches, leases): [`OutboxRuntime::inject_fault`] kills actors and
//!   [`testing::ScriptedTransport`] makes a broker fail, hang or crash after publishing.

#![warn(missing_docs)]
// The crate docs above link to items of optional features (`nats`, `testing`). CI documents
// every feature, where a broken link still fails; documenting fewer keeps the text and drops
// those links instead of failing.
#![cfg_attr(
    not(all(feature = "nats", feature = "testing")),
    allow(rustdoc::broken_intra_doc_links)
)]

pub mod admin;
mod consumer;
pub mod effects;
mod error;
pub mod event;
mod inbox;
#[cfg(test)]
mod layers;
#[cfg(test)]
mod layout;
mod maintenance;
mod messages;
#[cfg(test)]
mod msrv;
#[cfg(feature = "nats")]
pub mod nats;
mod outbox;
mod publisher;
mod reconciler;
mod retry;
mod runtime;
mod store;
mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;

// The names of the quick start; the rest live in the public modules below.
pub use consumer::{ConsumerConfig, Delivery, DeliveryBatch, DeliveryMode, HandlerError};
pub use error::{Error, ErrorCode, Result};
pub use event::{Event, EventId, EventRegistry, NewEvent};
pub use outbox::{enqueue, enqueue_many, enqueue_with};
pub use retry::RetryPolicy;
pub use runtime::{OutboxBuilder, OutboxHandle, OutboxRuntime, RuntimeConfig};
pub use store::connect;
pub use store::migrate::migrate;
pub use store::PgPool;

pub mod db {
    //! The database: pools and their connection settings, the library's migrations, a
    //! prepared statement marker, and the connection a delivery lends its handler.
    pub use crate::consumer::{SharedConn, TxConn};
    pub use crate::error::PoolError;
    pub use crate::store::access::{grant, grants, Role};
    pub use crate::store::migrate::{
        migrate, migrate_with, MigrateConfig, MigrateReport, Migration, MIGRATIONS,
    };
    pub use crate::store::schema::{schema, use_schema, DEFAULT_SCHEMA, SCHEMA_ENV};
    pub use crate::store::{connect, connect_with, ConnectionConfig, PgPool, Prepared};
}

pub mod health {
    //! Lag health and the stats sampler ([`HealthReport`], served by
    //! [`admin_scope`](crate::admin::admin_scope) too), the runtime's own status, and the
    //! boot-time contract check whose findings health reports.
    pub use crate::maintenance::{
        ConsumerHealth, HealthConfig, HealthReason, HealthReport, HealthState, OutboxHealth,
        StatsConfig, StatsSampler, Trend,
    };
    pub use crate::runtime::contract::ContractCheck;
    pub use crate::runtime::RuntimeStatus;
}

pub mod retention {
    //! Bounded deletes of delivered history and old idempotency keys (off by default;
    //! [`RuntimeConfig::retention`](crate::RuntimeConfig::retention)).
    pub use crate::maintenance::{Retention, RetentionConfig, RetentionReport};
}

pub mod transport {
    //! External transports: publishing to a broker under leases ([`Transport`],
    //! [`ExternalConfig`]), and the receiving side's inbox ([`receive`]).
    pub use crate::event::OutboxEvent;
    pub use crate::inbox::{receive, Received};
    pub use crate::messages::BoxFuture;
    pub use crate::publisher::{ExternalConfig, Transport, TransportError};
}

pub mod redact {
    //! What is left of an error message when it is stored (`last_error`) or logged: the
    //! default redaction, which an application's own
    //! ([`RuntimeConfig::redact_errors`](crate::RuntimeConfig::redact_errors)) may call.
    pub use crate::event::redact::default_redactor;
}

pub mod reconcile {
    //! Reconcile rules: desired-vs-actual checks whose repairs go through the same business
    //! idempotency keys as the consumers.
    pub use crate::messages::BoxFuture;
    pub use crate::reconciler::{DriftReport, ReconcileReport, ReconcileRule};
}

pub mod keys {
    //! Business idempotency keys: two different events never cause the same effect.
    pub use crate::inbox::{claim_key, KeyClaim, MAX_KEY_BYTES};
}

pub mod ops {
    //! Operator actions in code (the operator API offers them too): pause and resume a
    //! consumer, remove a subscription, replay processed events to one consumer, follow one
    //! correlation id, wake the publishers of other processes; and the names of the rows'
    //! states, as stored.
    pub use crate::inbox::{
        cancel_replay, pause_consumer, replay, replays, resume_consumer, unsubscribe, ReplayRange,
        DEFAULT_REPLAY_RATE, MAX_REPLAY_RATE,
    };
    pub use crate::outbox::{notify_publishers, timeline};
    pub use crate::store::replay::Replay;
    pub use crate::store::status::{InboxStatus, OutboxStatus};
    pub use crate::store::timeline::TimelineEntry;
}
