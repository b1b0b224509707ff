//! What the actors say to each other, and what instances say to each other through
//! PostgreSQL's `NOTIFY`. Defined here, below every actor, so that an actor depends on the
//! messages it handles or sends and never on the module of the actor at the other end.

use std::future::Future;
use std::pin::Pin;

use actix::prelude::*;

/// A boxed, sendable future, as returned by the methods of the traits an application
/// implements ([`ReconcileRule`](crate::reconcile::ReconcileRule), [`Transport`](crate::transport::Transport)).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// There may be work: claim now instead of at the next poll.
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "()")]
pub(crate) struct Wake;

/// Start nothing new; resolve once the work in flight has finished.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Drain;

/// Stop the actor (or, for fault injection, panic inside it). Sent and handled by the
/// supervisor alone (`runtime/supervisor.rs`).
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "()")]
pub(crate) struct Stop {
    /// Panic instead; read only with the `testing` feature.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub panic: bool,
}

/// The publisher wrote new inbox rows for these consumers (name, rows): the registry wakes
/// their actors.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct InboxRowsWritten {
    pub consumers: Vec<(String, usize)>,
}

/// Channel for "outbox rows were committed" (sent by [`notify_publishers`](crate::ops::notify_publishers)),
/// after the schema's name (`store::schema::channel`): `actix_outbox_outbox`.
pub(crate) const OUTBOX_CHANNEL: &str = "outbox";
/// Channel for "inbox rows were written"; the payload is `instance|consumer,consumer,…`, or
/// `instance|*` for every consumer when the names would not fit in one notification. After the
/// schema's name, as the other.
pub(crate) const INBOX_CHANNEL: &str = "inbox";
