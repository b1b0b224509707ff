//! `SupervisorActor`: owns every other actor, restarts the ones that die, and runs shutdown.
//!
//! actix's own `Supervisor` restarts an actor that stops itself but not one that panicked
//! (the panic ends the actor's task). So this actor checks its children's mailboxes on a short
//! interval and rebuilds any that closed, for whatever reason. Messages in a dead actor's
//! mailbox are lost, which costs nothing: every piece of work is a row in the database, found
//! again by the new actor's first claim.
//!
//! It also owns the lifecycle's two edges. At start it answers [`Ready`] only once every child
//! has run its `started`: actix runs `started` at an actor's first poll, and if the system is
//! dropped before that poll (the application returned an error right after `start`), actix
//! polls the actor once as it drops it, outside the tokio runtime, where the timers `started`
//! sets panic. At the end ([`Shutdown`], [`StopAll`]) it stops every child and waits until each
//! has stopped, for the same reason.

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures_util::future::{join_all, LocalBoxFuture};

use super::listener::{Heard, ListenerActor};
use super::{RuntimeConfig, RuntimeStatus, Stop, Wake};
use crate::consumer::actor::ConsumerActor;
use crate::consumer::registry::{ConsumerRegistry, SetMailbox};
use crate::consumer::threads::{HandlerFactory, HandlerThreads};
use crate::consumer::ConsumerConfig;
use crate::effects::{EffectSpec, EffectWorker};
use crate::error::{Error, Result};
use crate::maintenance::stats::StatsActor;
use crate::maintenance::Retention;
use crate::messages::InboxRowsWritten;
use crate::publisher::{PublisherActor, Route, SetRegistry};
use crate::reconciler::{
    DriftReport, LastReport, ReconcileReport, ReconcileRule, ReconcilerActor, RunNow,
};
use crate::store::PgPool;

mod shutdown;
pub(crate) use shutdown::{until_stopped, Shutdown, StopAll};

/// A NATS receiver and its actor, restarted like the other children.
#[cfg(feature = "nats")]
pub(crate) struct ReceiverSlot {
    pub receiver: crate::nats::NatsReceiver,
    pub addr: Option<Addr<crate::nats::NatsReceiverActor>>,
}

/// How long stopping waits for the children to be gone after telling them to stop. An actor
/// stops at its next poll (nothing in this crate delays its `stopping`), so this is a bound for
/// a busy thread, not a wait anyone should see.
pub(crate) const STOP_WAIT: Duration = Duration::from_secs(1);

/// A side-effect worker, restarted like the other children, and the thread its calls run on.
pub(crate) struct EffectSlot {
    spec: EffectSpec,
    thread: actix_rt::Arbiter,
    pub(super) addr: Option<Addr<EffectWorker>>,
}

impl EffectSlot {
    pub(crate) fn new(spec: EffectSpec) -> Result<Self> {
        let thread = actix_rt::Arbiter::try_new().map_err(|e| {
            Error::Config(format!(
                "could not start the thread of side effect {}: {e}",
                spec.config.kind
            ))
        })?;
        crate::store::open_connections_here_for(&thread.handle());
        Ok(EffectSlot {
            spec,
            thread,
            addr: None,
        })
    }
}

impl Drop for EffectSlot {
    fn drop(&mut self) {
        self.thread.stop();
    }
}

pub(crate) struct ConsumerSlot {
    pub cfg: Arc<ConsumerConfig>,
    pub factory: HandlerFactory,
    /// The threads of the consumer's group.
    pub threads: Vec<Option<actix_rt::ArbiterHandle>>,
    pub addr: Option<Addr<ConsumerActor>>,
}

pub(crate) struct SupervisorActor {
    pool: PgPool,
    config: RuntimeConfig,
    pub(super) consumers: Vec<ConsumerSlot>,
    rules: Vec<Rc<dyn ReconcileRule>>,
    route: Route,
    pub(super) registry: Option<Addr<ConsumerRegistry>>,
    pub(super) publisher: Option<Addr<PublisherActor>>,
    pub(super) reconciler: Option<Addr<ReconcilerActor>>,
    /// Holds a connection in LISTEN when `RuntimeConfig::listen` is on.
    listener: Option<Addr<ListenerActor>>,
    /// This runtime's id in notifications, so it can ignore its own.
    instance: Arc<str>,
    /// The stats sampler; it stops by itself once this address is dropped with the supervisor.
    stats: Option<Addr<StatsActor>>,
    /// Restarts per child name, for status and tests that count them.
    restarts: BTreeMap<String, u32>,
    /// Shutdown has begun: dead children stay dead.
    stopping: bool,
    /// What the stats sampler's samples are named, the same across its restarts.
    stats_instance: String,
    /// Retention, when configured.
    retention: Option<Rc<Retention>>,
    /// A retention run is in flight: the next tick does not start another.
    retaining: bool,
    /// The NATS receivers (feature `nats`).
    #[cfg(feature = "nats")]
    pub(super) receivers: Vec<ReceiverSlot>,
    /// The consumers' handler threads, stopped with this actor.
    _threads: HandlerThreads,
    /// The side-effect workers, each on a thread of its own.
    pub(super) effects: Vec<EffectSlot>,
}

/// The pause between retention runs while a backlog of expired rows lasts, instead of a whole
/// `retention_interval`: one run deletes at most `max_batches` batches per table, so at an
/// hourly interval a table gaining more than that many rows an hour would grow for ever.
const RETENTION_CATCH_UP: Duration = Duration::from_secs(1);

impl SupervisorActor {
    pub(crate) fn new(
        pool: PgPool,
        config: RuntimeConfig,
        consumers: Vec<ConsumerSlot>,
        rules: Vec<Rc<dyn ReconcileRule>>,
        route: Route,
        retention: Option<Rc<Retention>>,
        threads: HandlerThreads,
    ) -> Self {
        SupervisorActor {
            pool,
            config,
            consumers,
            rules,
            route,
            registry: None,
            publisher: None,
            reconciler: None,
            listener: None,
            instance: Arc::from(uuid::Uuid::now_v7().simple().to_string()),
            stats: None,
            restarts: BTreeMap::new(),
            stopping: false,
            stats_instance: crate::maintenance::stats::instance_name(),
            retention,
            retaining: false,
            #[cfg(feature = "nats")]
            receivers: Vec::new(),
            _threads: threads,
            effects: Vec::new(),
        }
    }

    /// One retention run, unless one is in flight; while runs leave expired rows behind, the
    /// next follows after [`RETENTION_CATCH_UP`].
    fn run_retention(&mut self, ctx: &mut Context<Self>) {
        let Some(retention) = self.retention.clone() else {
            return;
        };
        if self.stopping || self.retaining {
            return;
        }
        self.retaining = true;
        let run = async move { retention.run_once().await };
        ctx.spawn(run.into_actor(self).map(|result, act, ctx| {
            act.retaining = false;
            match result {
                Ok(report) => {
                    tracing::info!(?report, "retention run");
                    if report.more_left {
                        ctx.run_later(RETENTION_CATCH_UP, |act, ctx| act.run_retention(ctx));
                    }
                }
                Err(e) => tracing::warn!(error = %e, "retention run failed"),
            }
        }));
    }

    fn restarted(&mut self, child: &str) {
        *self.restarts.entry(child.to_owned()).or_default() += 1;
        tracing::warn!(child, "supervisor restarted a stopped actor");
    }

    /// Starts every child that is not running. The first call starts them all.
    fn ensure_children(&mut self) {
        if self.stopping {
            return;
        }
        let first_start = self.registry.is_none();
        let registry_alive = self.registry.as_ref().is_some_and(|a| a.connected());
        if !registry_alive {
            if !first_start {
                self.restarted("registry");
            }
            let registry = ConsumerRegistry::default().start();
            for slot in &self.consumers {
                if let Some(addr) = &slot.addr {
                    registry.do_send(SetMailbox {
                        consumer: slot.cfg.name.to_string(),
                        addr: addr.clone(),
                    });
                }
            }
            if let Some(publisher) = &self.publisher {
                publisher.do_send(SetRegistry(registry.clone().recipient()));
            }
            self.registry = Some(registry);
        }
        let Some(registry) = self.registry.clone() else {
            return;
        };

        let mut restarted = Vec::new();
        for slot in &mut self.consumers {
            if slot.addr.as_ref().is_some_and(|a| a.connected()) {
                continue;
            }
            if slot.addr.is_some() {
                restarted.push(format!("consumer:{}", slot.cfg.name));
            }
            let addr = ConsumerActor::new(
                slot.cfg.clone(),
                self.pool.clone(),
                slot.factory.clone(),
                slot.threads.clone(),
            )
            .start();
            registry.do_send(SetMailbox {
                consumer: slot.cfg.name.to_string(),
                addr: addr.clone(),
            });
            slot.addr = Some(addr);
        }
        for child in restarted {
            self.restarted(&child);
        }

        if !self.publisher.as_ref().is_some_and(|a| a.connected()) {
            if self.publisher.is_some() {
                self.restarted("publisher");
            }
            let publisher = PublisherActor::new(
                self.pool.clone(),
                registry.recipient(),
                self.route.clone(),
                self.config.publish_batch_size,
                self.config.poll_interval,
                self.config.publish_gap,
                self.config.listen.then(|| self.instance.clone()),
            );
            self.publisher = Some(publisher.start());
        }

        if !self.reconciler.as_ref().is_some_and(|a| a.connected()) {
            if self.reconciler.is_some() {
                self.restarted("reconciler");
            }
            let reconciler = ReconcilerActor::new(
                self.pool.clone(),
                self.rules.clone(),
                self.config.reconcile_interval,
                self.config.consistency_window,
                self.config.reconcile_dry_run,
                self.config.redact.clone(),
            );
            self.reconciler = Some(reconciler.start());
        }

        let mut restarted = Vec::new();
        for slot in &mut self.effects {
            if slot.addr.as_ref().is_some_and(|a| a.connected()) {
                continue;
            }
            if slot.addr.is_some() {
                restarted.push(format!("effect:{}", slot.spec.config.kind));
            }
            let worker =
                EffectWorker::new(self.pool.clone(), slot.spec.clone(), slot.thread.handle());
            slot.addr = Some(worker.start());
        }
        for child in restarted {
            self.restarted(&child);
        }

        if !self.stats.as_ref().is_some_and(|a| a.connected()) {
            if self.stats.is_some() {
                self.restarted("stats");
            }
            let stats = StatsActor::new(
                self.pool.clone(),
                self.config.stats.clone(),
                self.stats_instance.clone(),
            );
            self.stats = Some(stats.start());
        }
    }
}

impl SupervisorActor {
    /// Starts every NATS receiver that is not running; they wake this runtime's consumers
    /// through the supervisor, which outlives a restarted registry.
    #[cfg(feature = "nats")]
    fn ensure_receivers(&mut self, ctx: &mut Context<Self>) {
        if self.stopping {
            return;
        }
        let mut restarted = Vec::new();
        for slot in &mut self.receivers {
            if slot.addr.as_ref().is_some_and(|a| a.connected()) {
                continue;
            }
            if slot.addr.is_some() {
                restarted.push(slot.receiver.name());
            }
            let deps = crate::nats::ReceiverDeps {
                pool: self.pool.clone(),
                wake: ctx.address().recipient(),
            };
            slot.addr =
                Some(crate::nats::NatsReceiverActor::new(slot.receiver.clone(), deps).start());
        }
        for child in restarted {
            self.restarted(&child);
        }
    }

    #[cfg(not(feature = "nats"))]
    fn ensure_receivers(&mut self, _: &mut Context<Self>) {}

    fn ensure_listener(&mut self, ctx: &mut Context<Self>) {
        if self.stopping
            || !self.config.listen
            || self.listener.as_ref().is_some_and(|a| a.connected())
        {
            return;
        }
        if self.listener.is_some() {
            self.restarted("listener");
        }
        let listener = ListenerActor::new(
            self.pool.clone(),
            self.instance.clone(),
            ctx.address().recipient(),
        );
        self.listener = Some(listener.start());
    }
}

impl Actor for SupervisorActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if tokio::runtime::Handle::try_current().is_err() {
            // This first poll is actix dropping the actor (with its system) before it ever ran:
            // outside the runtime, starting children and timers would panic. Nothing started.
            self.stopping = true;
            ctx.stop();
            return;
        }
        self.ensure_children();
        self.ensure_receivers(ctx);
        self.ensure_listener(ctx);
        // Built and validated by the builder; each run is bounded and its deletes are short
        // transactions, so it runs here rather than in an actor of its own. The first run is at
        // start: a process restarted more often than the interval would otherwise never run one.
        if self.retention.is_some() {
            self.run_retention(ctx);
            ctx.run_interval(self.config.retention_interval, |act, ctx| {
                act.run_retention(ctx)
            });
        }
        ctx.run_interval(self.config.supervise_interval, |act, ctx| {
            act.ensure_children();
            act.ensure_receivers(ctx);
            act.ensure_listener(ctx);
        });
    }
}

impl Handler<Heard> for SupervisorActor {
    type Result = ();
    fn handle(&mut self, heard: Heard, _: &mut Context<Self>) {
        match heard {
            Heard::Outbox => {
                if let Some(p) = &self.publisher {
                    let _ = p.try_send(Wake);
                }
            }
            Heard::Inbox(mut consumers) => {
                if consumers.iter().any(|c| c == "*") {
                    consumers = self
                        .consumers
                        .iter()
                        .map(|s| s.cfg.name.as_str().to_owned())
                        .collect();
                }
                if let Some(r) = &self.registry {
                    // The registry wakes only the consumers this instance runs.
                    let consumers = consumers.into_iter().map(|c| (c, 0)).collect();
                    let _ = r.try_send(InboxRowsWritten { consumers });
                }
            }
        }
    }
}

/// Inbox rows written by a receiver of this runtime; `*` is every consumer.
impl Handler<InboxRowsWritten> for SupervisorActor {
    type Result = ();
    fn handle(&mut self, mut rows: InboxRowsWritten, _: &mut Context<Self>) {
        if rows.consumers.iter().any(|(c, _)| c == "*") {
            rows.consumers = self
                .consumers
                .iter()
                .map(|s| (s.cfg.name.as_str().to_owned(), 0))
                .collect();
        }
        if let Some(r) = &self.registry {
            let _ = r.try_send(rows);
        }
    }
}

impl Handler<Wake> for SupervisorActor {
    type Result = ();
    fn handle(&mut self, _: Wake, _: &mut Context<Self>) {
        if let Some(publisher) = &self.publisher {
            // A full mailbox already holds a wake-up; a dead publisher's successor claims on start.
            let _ = publisher.try_send(Wake);
        }
    }
}

/// Current restart counts and the reconciler's last report.
#[derive(Message)]
#[rtype(result = "RuntimeStatus")]
pub(crate) struct GetStatus;

impl Handler<GetStatus> for SupervisorActor {
    type Result = ResponseFuture<RuntimeStatus>;
    fn handle(&mut self, _: GetStatus, _: &mut Context<Self>) -> Self::Result {
        let restarts = self.restarts.clone();
        let reconciler = self.reconciler.clone();
        Box::pin(async move {
            let drift: Option<DriftReport> = match reconciler {
                Some(r) => r.send(LastReport).await.ok().flatten(),
                None => None,
            };
            RuntimeStatus { restarts, drift }
        })
    }
}

/// Run every reconcile rule now.
#[derive(Message)]
#[rtype(result = "Vec<crate::Result<ReconcileReport>>")]
pub(crate) struct ReconcileNow;

impl Handler<ReconcileNow> for SupervisorActor {
    type Result = ResponseFuture<Vec<crate::Result<ReconcileReport>>>;
    fn handle(&mut self, _: ReconcileNow, _: &mut Context<Self>) -> Self::Result {
        let reconciler = self.reconciler.clone();
        Box::pin(async move {
            match reconciler {
                Some(r) => r.send(RunNow).await.unwrap_or_default(),
                None => Vec::new(),
            }
        })
    }
}

/// A child's answer to a message whose reply carries nothing.
type Reply = LocalBoxFuture<'static, Result<(), MailboxError>>;

/// Answered by every child, once it has started (an actor runs `started` before it reads its
/// mailbox), so [`Ready`] can tell that all of them have.
#[derive(Message)]
#[rtype(result = "()")]
struct Ping;

/// What every child answers, implemented here since only the supervisor sends it: [`Ping`]
/// (it has started), and [`Stop`]. With the `testing` feature, `Stop`'s `panic` makes the
/// child panic instead ([`Fault`](crate::testing::Fault)), which is how the tests exercise
/// the restart.
macro_rules! child {
    ($($actor:ty),* $(,)?) => {$(
        impl Handler<Ping> for $actor {
            type Result = ();
            fn handle(&mut self, _: Ping, _: &mut Context<Self>) {}
        }

        impl Handler<Stop> for $actor {
            type Result = ();
            fn handle(&mut self, stop: Stop, ctx: &mut Context<Self>) {
                #[cfg(feature = "testing")]
                if stop.panic {
                    panic!("fault injection: {} panicked", std::any::type_name::<Self>());
                }
                let _ = stop;
                ctx.stop();
            }
        }
    )*};
}

child!(
    ConsumerRegistry,
    ConsumerActor,
    PublisherActor,
    ReconcilerActor,
    StatsActor,
    ListenerActor,
    EffectWorker,
);
#[cfg(feature = "nats")]
child!(crate::nats::NatsReceiverActor);

/// Resolves once every child has started: true, or false if one of them stopped first.
#[derive(Message)]
#[rtype(result = "bool")]
pub(crate) struct Ready;

impl Handler<Ready> for SupervisorActor {
    type Result = ResponseFuture<bool>;
    fn handle(&mut self, _: Ready, _: &mut Context<Self>) -> Self::Result {
        let mut pings: Vec<Reply> = Vec::new();
        for slot in &self.consumers {
            if let Some(a) = &slot.addr {
                pings.push(Box::pin(a.send(Ping)));
            }
        }
        if let Some(a) = &self.registry {
            pings.push(Box::pin(a.send(Ping)));
        }
        if let Some(a) = &self.publisher {
            pings.push(Box::pin(a.send(Ping)));
        }
        if let Some(a) = &self.reconciler {
            pings.push(Box::pin(a.send(Ping)));
        }
        if let Some(a) = &self.stats {
            pings.push(Box::pin(a.send(Ping)));
        }
        if let Some(a) = &self.listener {
            pings.push(Box::pin(a.send(Ping)));
        }
        for slot in &self.effects {
            if let Some(a) = &slot.addr {
                pings.push(Box::pin(a.send(Ping)));
            }
        }
        #[cfg(feature = "nats")]
        for slot in &self.receivers {
            if let Some(a) = &slot.addr {
                pings.push(Box::pin(a.send(Ping)));
            }
        }
        // Nothing started (see `started`): not ready.
        let started = self.registry.is_some();
        Box::pin(async move { started && join_all(pings).await.iter().all(Result::is_ok) })
    }
}
