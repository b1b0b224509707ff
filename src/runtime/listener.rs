//! `ListenerActor`: the cross-instance fast path. It holds one connection in `LISTEN`
//! and turns notifications into local wake-ups, so an instance hears within milliseconds about
//! inbox rows another instance's publisher wrote, or about events a process without a runtime
//! committed. Polling stays the backstop: a lost notification, or a listener that is down,
//! costs latency only.

use std::time::Duration;

use actix::prelude::*;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::future::{select, Either};
use futures_util::StreamExt;

use crate::error::{Error, Result};
use crate::messages::{INBOX_CHANNEL, OUTBOX_CHANNEL};
use crate::store::{self, PgPool};

/// A notification arrived; the supervisor routes it.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub(crate) enum Heard {
    /// Wake the publisher.
    Outbox,
    /// Wake these consumers (`*`: all of them).
    Inbox(Vec<String>),
}

pub(crate) struct ListenerActor {
    pool: PgPool,
    /// This instance's id: its own publisher's notifications are skipped, it woke its
    /// consumers directly already.
    me: std::sync::Arc<str>,
    /// Where notifications go.
    supervisor: Recipient<Heard>,
}

impl ListenerActor {
    pub(crate) fn new(pool: PgPool, me: std::sync::Arc<str>, supervisor: Recipient<Heard>) -> Self {
        ListenerActor {
            pool,
            me,
            supervisor,
        }
    }
}

/// How long the `LISTEN` connection may stay quiet before it is asked to answer a
/// round trip. A connection cut by a path that still acknowledges packets delivers nothing
/// and reports no error: only a round trip shows it is dead. With the bound on that round
/// trip, a dead listener is replaced within this plus [`store::DB_TIMEOUT`].
const HEARTBEAT: Duration = Duration::from_secs(10);

impl Actor for ListenerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let (pool, supervisor, me) = (self.pool.clone(), self.supervisor.clone(), self.me.clone());
        let listen = async move {
            if let Err(e) = listen(&pool, &me, &supervisor).await {
                tracing::warn!(error = %e, code = %e.code(), "listener stopped");
            }
        };
        // When the connection fails the loop ends and the actor stops; the supervisor starts a
        // new one with a new connection.
        ctx.spawn(listen.into_actor(self).map(|(), _, ctx| ctx.stop()));
    }
}

/// Listens until the connection fails or stops answering.
async fn listen(pool: &PgPool, me: &str, supervisor: &Recipient<Heard>) -> Result<()> {
    // A connection of its own, outside the pool: when the actor stops, dropping it closes it.
    // A pooled one would go back to the pool still listening, and its notifications would pile
    // up there unread. Bounded here too: a pool built without
    // [`ConnectionConfig`](crate::db::ConnectionConfig) does not bound establishing one.
    let mut conn = match store::timed(store::DB_TIMEOUT, async {
        pool.dedicated_connection()
            .await
            .map_err(|e| Error::Pool(crate::error::PoolError::connect(e)))
    })
    .await
    {
        Ok(conn) => conn?,
        Err(t) => return Err(Error::DatabaseTimeout(t.0)),
    };
    // One round trip; the text starts with the inbox channel, which tests look for.
    let listen = format!(
        "LISTEN {}; LISTEN {}",
        store::schema::channel(INBOX_CHANNEL),
        store::schema::channel(OUTBOX_CHANNEL)
    );
    let round_trip = async |conn: &mut AsyncPgConnection| {
        store::bounded(conn, store::DB_TIMEOUT, async |c| {
            c.batch_execute(&listen).await?;
            Ok(())
        })
        .await
    };
    round_trip(&mut conn).await?;
    loop {
        let quiet = {
            let mut stream = std::pin::pin!(conn.notifications_stream());
            loop {
                let heartbeat = std::pin::pin!(tokio::time::sleep(HEARTBEAT));
                match select(stream.next(), heartbeat).await {
                    Either::Left((Some(Ok(n)), _)) => {
                        if let Some(heard) = heard(me, n) {
                            supervisor.do_send(heard);
                        }
                    }
                    Either::Left((Some(Err(e)), _)) => break Err(Error::from(e)),
                    Either::Left((None, _)) => break Ok(false),
                    Either::Right(_) => break Ok(true),
                }
            }
        };
        if !quiet? {
            return Ok(());
        }
        // The heartbeat repeats the LISTEN (a no-op for channels already listened to), so the
        // session still shows what it is for in `pg_stat_activity`. Notifications that arrive
        // meanwhile wait in the connection's queue.
        round_trip(&mut conn).await?;
    }
}

/// What a notification asks for; `None` for this instance's own.
fn heard(me: &str, n: diesel::pg::PgNotification) -> Option<Heard> {
    if n.channel != store::schema::channel(INBOX_CHANNEL) {
        return Some(Heard::Outbox);
    }
    let (from, consumers) = n
        .payload
        .split_once('|')
        .unwrap_or(("", n.payload.as_str()));
    if from == me {
        return None;
    }
    Some(Heard::Inbox(
        consumers
            .split(',')
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect(),
    ))
}
