//! The runtime: configuration, the builder that registers consumers, the handle the
//! application keeps, and the supervisor that owns the actors.

mod config;
pub(crate) mod contract;
#[cfg(feature = "testing")]
mod fault;
mod listener;
mod preflight;
mod supervisor;

pub use config::RuntimeConfig;

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

use actix::prelude::*;

use crate::consumer::actor::HandlerRef;
use crate::consumer::function::FnConsumer;
use crate::consumer::threads::{HandlerFactory, HandlerThreads};
use crate::consumer::{ConsumerConfig, Delivery, DeliveryBatch, HandlerError};
use crate::effects::{EffectConfig, EffectSpec, Perform};
use crate::error::{Error, Result};
use crate::event::EventRegistry;
use crate::maintenance::Retention;
use crate::messages::{Stop, Wake};
use crate::publisher::{ExternalConfig, Route, Transport};
use crate::reconciler::{DriftReport, ReconcileReport, ReconcileRule};
use crate::store::{self, PgPool};
use supervisor::{
    until_stopped, ConsumerSlot, GetStatus, Ready, ReconcileNow, Shutdown, StopAll,
    SupervisorActor, STOP_WAIT,
};

/// Registers consumers and starts the runtime. Made by [`OutboxRuntime::builder`].
pub struct OutboxBuilder {
    pool: PgPool,
    config: RuntimeConfig,
    consumers: Vec<(ConsumerConfig, HandlerFactory)>,
    rules: Vec<Rc<dyn ReconcileRule>>,
    route: Route,
    events: Option<Arc<EventRegistry>>,
    effects: Vec<(EffectConfig, Perform)>,
    #[cfg(feature = "nats")]
    receivers: Vec<crate::nats::NatsReceiver>,
}

impl OutboxBuilder {
    /// Runs a NATS JetStream receiver (feature `nats`) as a supervised actor of this runtime:
    /// its messages become inbox rows of this runtime's database, for the consumers registered
    /// here (and in every other instance on the database) that subscribe to their types. Each
    /// receiver is restarted when it dies and drained at shutdown.
    #[cfg(feature = "nats")]
    pub fn nats_receiver(mut self, receiver: crate::nats::NatsReceiver) -> Self {
        self.receivers.push(receiver);
        self
    }

    /// Gives the runtime the application's event types: deliveries of an older version are
    /// upcast to the current one before the handler sees them; an older version no upcaster
    /// lifts is dead-lettered on its first attempt with `EVENT_VERSION_UNSUPPORTED`, and a
    /// newer one than this build reads fails with that code but is retried on the consumer's
    /// policy (an instance of the newer build may take it). Handlers' follow-ups
    /// ([`Delivery::enqueue`](crate::Delivery::enqueue)) are validated with it.
    pub fn events(mut self, registry: EventRegistry) -> Self {
        self.events = Some(Arc::new(registry));
        self
    }

    /// Publishes events through an external `transport` (a broker) under leases, instead of
    /// fanning them out to this database's inboxes. Consumers in this process then receive
    /// events through the transport's receiving side ([`receive`](crate::transport::receive)).
    pub fn external_transport(mut self, transport: impl Transport, config: ExternalConfig) -> Self {
        self.route = Route::External(Rc::new(transport), Rc::new(config));
        self
    }

    /// Runs the worker of one kind of side effect: `perform` makes the call for each effect
    /// of `config`'s kind that handlers recorded ([`effects::record`](crate::effects::record)),
    /// outside any transaction, with the effect's key for the provider to deduplicate on.
    /// `Ok` marks it done; an error is retried or dead-lettered on the config's policy, as a
    /// consumer's. The worker runs on a thread of its own, is restarted when it dies and is
    /// drained at shutdown; `perform` must therefore be `Send + Sync` (its future need not be).
    pub fn effect<F, Fut>(mut self, config: EffectConfig, perform: F) -> Self
    where
        F: Fn(crate::effects::Effect) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = std::result::Result<(), HandlerError>> + 'static,
    {
        let perform: Perform = Arc::new(move |e| Box::pin(perform(e)));
        self.effects.push((config, perform));
        self
    }

    /// Registers a reconcile rule, run by the `ReconcilerActor` on the rule's interval.
    pub fn reconcile(mut self, rule: impl ReconcileRule) -> Self {
        self.rules.push(Rc::new(rule));
        self
    }

    /// Replaces the runtime settings.
    pub fn config(mut self, config: RuntimeConfig) -> Self {
        self.config = config;
        self
    }

    /// Registers a consumer: `make` builds the actor that handles its [`Delivery`] messages.
    /// It is called once at start and again whenever that actor has died (a panic in its
    /// `handle`, or the actor stopping itself), so it should build a fresh actor from cheap,
    /// cloneable parts.
    ///
    /// `make` runs on the consumer's handler threads ([`ConsumerConfig::threads`]), once per
    /// thread, so it must be `Send + Sync`; the actor it returns need not be `Send`.
    pub fn consumer<A, F>(mut self, config: ConsumerConfig, make: F) -> Self
    where
        A: Actor<Context = Context<A>> + Handler<Delivery>,
        F: Fn() -> A + Send + Sync + 'static,
    {
        let factory: HandlerFactory = Arc::new(move || HandlerRef::One(make().start().recipient()));
        self.consumers.push((config, factory));
        self
    }

    /// Registers a batch consumer: `make` builds the actor that handles its [`DeliveryBatch`]
    /// messages, each holding up to [`ConsumerConfig::batch_size`] events that commit in one
    /// transaction. For handlers that can write a whole batch's effects in one statement;
    /// rebuilt like [`OutboxBuilder::consumer`]'s actor.
    pub fn batch_consumer<A, F>(mut self, config: ConsumerConfig, make: F) -> Self
    where
        A: Actor<Context = Context<A>> + Handler<DeliveryBatch>,
        F: Fn() -> A + Send + Sync + 'static,
    {
        let factory: HandlerFactory =
            Arc::new(move || HandlerRef::Batch(make().start().recipient()));
        self.consumers.push((config, factory));
        self
    }

    /// Registers a consumer written as a plain async function of its [`Delivery`], for a
    /// handler that keeps no state between events; everything else is as for
    /// [`OutboxBuilder::consumer`] (the function's effects go through [`Delivery::conn`] and
    /// commit with the inbox mark). The function is cloned into each handler actor.
    ///
    /// ```no_run
    /// # use actix_outbox::{ConsumerConfig, HandlerError, OutboxRuntime, PgPool};
    /// # fn f(pool: PgPool) -> actix_outbox::Result<()> {
    /// let builder = OutboxRuntime::builder(pool).consumer_fn(
    ///     ConsumerConfig::new("audit").subscribe("ORDER_PLACED"),
    ///     |d| async move {
    ///         let _conn = d.conn().await?;
    ///         // … write the effect through `_conn` …
    ///         Ok::<(), HandlerError>(())
    ///     },
    /// );
    /// # Ok(()) }
    /// ```
    pub fn consumer_fn<F, Fut>(self, config: ConsumerConfig, f: F) -> Self
    where
        F: Fn(Delivery) -> Fut + Clone + Send + Sync + 'static,
        Fut: std::future::Future<Output = std::result::Result<(), HandlerError>> + 'static,
    {
        self.consumer(config, move || FnConsumer(Box::new(f.clone())))
    }

    /// Registers a batch consumer written as a plain async function of its
    /// [`DeliveryBatch`]; see [`OutboxBuilder::consumer_fn`] and
    /// [`OutboxBuilder::batch_consumer`].
    pub fn batch_consumer_fn<F, Fut>(self, config: ConsumerConfig, f: F) -> Self
    where
        F: Fn(DeliveryBatch) -> Fut + Clone + Send + Sync + 'static,
        Fut: std::future::Future<Output = std::result::Result<(), HandlerError>> + 'static,
    {
        self.batch_consumer(config, move || FnConsumer(Box::new(f.clone())))
    }

    /// Records the consumers' subscriptions in the database and starts the actors; returns once
    /// every actor has started. Must be called inside an actix system (`#[actix_web::main]`,
    /// `#[actix_rt::main]`). The library's tables must exist: run [`migrate`](crate::migrate)
    /// first.
    ///
    /// Everything that can be checked is checked before the first actor starts; should a start
    /// still fail once actors exist, they are stopped (and gone) before the error is returned.
    /// Either way, an error leaves nothing behind in the actix system.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid or duplicate settings; [`Error::Database`] or
    /// [`Error::Pool`] when the subscriptions cannot be written; [`Error::Stopped`] when an
    /// actor of the runtime stopped before the start finished.
    ///
    /// # Cancel safety
    /// Dropping the future before it resolves stops whatever it had started.
    pub async fn start(mut self) -> Result<OutboxRuntime> {
        crate::store::schema::check()?;
        self.config.validate()?;
        if let Route::External(_, cfg) = &mut self.route {
            cfg.validate()?;
            Rc::make_mut(cfg).redact = self.config.redact.clone();
        }
        let mut rules = std::collections::HashSet::new();
        for rule in &self.rules {
            // A zero interval would run the rule in a loop that starves every other actor, and a
            // zero time bound means none to PostgreSQL; two rules of one name would share one
            // advisory lock and one history.
            let zero = rule.interval().is_zero() || rule.time_bound().is_zero();
            if zero || !rules.insert(rule.name().to_owned()) {
                return Err(Error::Config(format!(
                    "reconcile rule {}: a zero interval or time bound, or a name used twice",
                    rule.name()
                )));
            }
        }
        // Built here, not by the supervisor: it can fail, and nothing has started yet.
        let retention = match &self.config.retention {
            Some(cfg) => Some(Rc::new(Retention::new(self.pool.clone(), cfg.clone())?)),
            None => None,
        };
        #[cfg(feature = "nats")]
        for r in &self.receivers {
            r.check_retention(
                self.config
                    .retention
                    .as_ref()
                    .map(|c| c.processed_inbox_after),
            )?;
        }
        let mut names = std::collections::HashSet::new();
        for (cfg, _) in &self.consumers {
            cfg.validate()?;
            if !names.insert(cfg.name.clone()) {
                return Err(Error::Config(format!(
                    "consumer {} registered twice",
                    cfg.name
                )));
            }
        }
        let mut kinds = std::collections::HashSet::new();
        for (cfg, _) in &self.effects {
            cfg.validate()?;
            if !kinds.insert(cfg.kind.clone()) {
                return Err(Error::Config(format!(
                    "side effect {} registered twice",
                    cfg.kind
                )));
            }
        }
        // Privileges, the schema's version and the pooler, before anything is written.
        preflight::check(&self.pool, self.config.pooler_check).await?;
        {
            let mut conn = self.pool.get().await?;
            let mut registered = Vec::with_capacity(self.consumers.len());
            for (cfg, _) in &self.consumers {
                let (extra, retiring) = store::inbox::register_consumer(
                    &mut conn,
                    cfg.name.as_str(),
                    &cfg.event_types,
                    cfg.ordered,
                    cfg.replay_safe,
                    cfg.delay_levels(),
                    cfg.cursor.then_some(&cfg.high[..]),
                )
                .await?;
                cfg.retiring
                    .store(retiring, std::sync::atomic::Ordering::Relaxed);
                registered.push(contract::Registered {
                    cfg,
                    extra,
                    low_readers: Vec::new(),
                });
            }
            // Once all are registered: a LOW reader may be one of this build's consumers.
            for r in registered.iter_mut().filter(|r| !r.cfg.high.is_empty()) {
                r.low_readers =
                    store::inbox::high_overruled(&mut conn, r.cfg.name.as_str()).await?;
            }
            let (mode, window) = (self.config.contract_check, self.config.contract_window);
            let events = self.events.as_deref();
            contract::check(&mut conn, mode, window, &registered, events).await?;
        }
        let cfgs: Vec<&ConsumerConfig> = self.consumers.iter().map(|(c, _)| c).collect();
        let (threads, shares) = HandlerThreads::start(&cfgs)?;
        let slots = self
            .consumers
            .into_iter()
            .zip(shares)
            .map(|((mut cfg, factory), threads)| {
                cfg.events = self.events.clone();
                cfg.redact = self.config.redact.clone();
                ConsumerSlot {
                    cfg: Arc::new(cfg),
                    factory,
                    threads,
                    addr: None,
                }
            })
            .collect();
        let redact = self.config.redact.clone();
        let effects = self
            .effects
            .into_iter()
            .map(|(config, perform)| EffectSpec {
                config: Arc::new(config),
                perform,
                redact: redact.clone(),
            })
            .map(supervisor::EffectSlot::new)
            .collect::<Result<Vec<_>>>()?;
        let mut supervisor = SupervisorActor::new(
            self.pool,
            self.config,
            slots,
            self.rules,
            self.route,
            retention,
            threads,
        );
        supervisor.effects = effects;
        #[cfg(feature = "nats")]
        {
            let mut names = std::collections::HashSet::new();
            for r in &self.receivers {
                if !names.insert(r.name()) {
                    return Err(Error::Config(format!("{} registered twice", r.name())));
                }
            }
            supervisor.receivers = self
                .receivers
                .into_iter()
                .map(|receiver| supervisor::ReceiverSlot {
                    receiver,
                    addr: None,
                })
                .collect();
        }
        let supervisor = supervisor.start();
        let mut started = Starting(Some(supervisor.clone()));
        // An actor runs `started` at its first poll. Returning before every actor has had it
        // would leave the application's next error (its own start-up failing after this one)
        // to drop the system with actors that never ran: actix then polls them once as it
        // drops them, outside the runtime, and the timers their `started` sets panic.
        if supervisor.send(Ready).await.unwrap_or(false) {
            started.0 = None;
            return Ok(OutboxRuntime {
                handle: OutboxHandle { supervisor },
            });
        }
        tracing::error!("an actor of the outbox runtime stopped while the runtime started");
        started.0 = None;
        let _ = supervisor.send(StopAll).await;
        until_stopped(|| supervisor.connected(), STOP_WAIT).await;
        Err(Error::Stopped)
    }
}

/// A supervisor whose start has not finished: if `start`'s future is dropped, it stops
/// everything it had started instead of leaving a runtime nobody can shut down.
struct Starting(Option<Addr<SupervisorActor>>);

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(supervisor) = self.0.take() {
            supervisor.do_send(StopAll);
        }
    }
}

/// The running runtime. Dropping it does not stop the actors; call [`OutboxRuntime::shutdown`].
pub struct OutboxRuntime {
    handle: OutboxHandle,
}

impl OutboxRuntime {
    /// Starts building a runtime on `pool`. The pool should allow at least
    /// 4 + Σ consumer concurrency connections (the publisher and its lease reaper, the
    /// reconciler, the stats sampler, and one per consumer batch loop), and Σ concurrency more
    /// for handlers that overrun their timeout keeping their connection: each consumer parks
    /// at most `concurrency` of them and then waits, so this bound holds however they hang.
    /// Give it a pool of its own rather than the application's. Outside the pool, through the
    /// pool's manager, the runtime opens one connection held in `LISTEN` (see
    /// [`RuntimeConfig::listen`]).
    pub fn builder(pool: PgPool) -> OutboxBuilder {
        OutboxBuilder {
            pool,
            config: RuntimeConfig::default(),
            consumers: Vec::new(),
            rules: Vec::new(),
            route: Route::InProcess,
            events: None,
            effects: Vec::new(),
            #[cfg(feature = "nats")]
            receivers: Vec::new(),
        }
    }

    /// A cheap, cloneable, `Send` handle for request handlers.
    pub fn handle(&self) -> OutboxHandle {
        self.handle.clone()
    }

    /// Restart counts and the reconciler's last report.
    ///
    /// # Errors
    /// [`Error::Stopped`] after shutdown.
    pub async fn status(&self) -> Result<RuntimeStatus> {
        self.handle
            .supervisor
            .send(GetStatus)
            .await
            .map_err(|_| Error::Stopped)
    }

    /// Runs every reconcile rule now (in registration order) instead of waiting for its
    /// interval, and returns what each run did.
    ///
    /// # Errors
    /// [`Error::Stopped`] after shutdown; per rule, the error its run hit.
    pub async fn reconcile_now(&self) -> Result<Vec<Result<ReconcileReport>>> {
        self.handle
            .supervisor
            .send(ReconcileNow)
            .await
            .map_err(|_| Error::Stopped)
    }

    /// Graceful shutdown: the publisher and every consumer stop claiming at once, then finish
    /// the work in flight side by side, each within [`RuntimeConfig::shutdown_timeout`] (a
    /// publisher stuck on a hung broker does not take the consumers' time), then every actor
    /// stops. Work still running at the deadline is cut off: a consumer's batch rolls back and
    /// is delivered again after the next start; an external publish in flight keeps its lease
    /// until it expires, and is published again then. Resolves once every actor has stopped,
    /// so the actix system can be dropped right after. Calling it again after the runtime has
    /// stopped does nothing.
    ///
    /// Returns whether everything in flight finished before the deadline.
    pub async fn shutdown(&self) -> bool {
        let supervisor = &self.handle.supervisor;
        let finished = supervisor.send(Shutdown).await.unwrap_or(true);
        until_stopped(|| supervisor.connected(), STOP_WAIT).await;
        finished
    }

    /// Fault injection for tests: stops (or panics) one of the runtime's actors, as a crash
    /// would. Returns whether the actor was running.
    #[cfg(feature = "testing")]
    pub async fn inject_fault(&self, fault: Fault) -> bool {
        use fault::{Child, StopChild};
        let (child, panic) = match fault {
            Fault::StopPublisher => (Child::Publisher, false),
            Fault::PanicPublisher => (Child::Publisher, true),
            Fault::PanicRegistry => (Child::Registry, true),
            Fault::PanicReconciler => (Child::Reconciler, true),
            Fault::PanicConsumer(name) => (Child::Consumer(name), true),
        };
        self.handle
            .supervisor
            .send(StopChild { child, panic })
            .await
            .unwrap_or(false)
    }
}

/// Faults [`OutboxRuntime::inject_fault`] can cause.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The publisher stops itself.
    StopPublisher,
    /// The publisher panics.
    PanicPublisher,
    /// The consumer registry panics.
    PanicRegistry,
    /// The reconciler panics.
    PanicReconciler,
    /// The named consumer's actor panics.
    PanicConsumer(String),
}

/// What the supervisor knows about its children.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct RuntimeStatus {
    /// Restarts per child (`publisher`, `registry`, `reconciler`, `stats`, `listener`,
    /// `consumer:NAME`).
    pub restarts: BTreeMap<String, u32>,
    /// The reconciler's last built-in check, once one has run.
    pub drift: Option<DriftReport>,
}

/// A handle to a running runtime: `Clone + Send`, for request handlers in any worker thread.
#[derive(Clone)]
pub struct OutboxHandle {
    supervisor: Addr<SupervisorActor>,
}

impl OutboxHandle {
    /// Tells the publisher that events were just committed, so it claims them now instead of
    /// at its next poll. Call it after the commit (a wake before the commit finds nothing).
    /// Never blocks and never fails: a wake that cannot be queued is covered by the poll.
    pub fn wake(&self) {
        let _ = self.supervisor.try_send(Wake);
    }
}
