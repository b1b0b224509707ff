//! `ListenerActor`: the cross-instance fast path. It holds one connection in `LISTEN`
//! and turns notifications into local wake-ups, so an instance hears within milliseconds about
//! inbox rows another instance's publisher wrote, or about events a process without a runtime
//! committed. Polling stays the backstop: a lost notification, or a listener that is down,
//! costs latency only.

use actix::prelude::*;
use diesel_async::RunQueryDsl;
use futures_util::StreamExt;

use crate::runtime::Stop;
use crate::store::PgPool;

/// Channel for "outbox rows were committed" (sent by [`notify_publishers`](crate::notify_publishers)).
pub(crate) const OUTBOX_CHANNEL: &str = "actix_outbox_outbox";
/// Channel for "inbox rows were written"; the payload is `instance|consumer,consumer,…`, or
/// `instance|*` for every consumer when the names would not fit in one notification.
pub(crate) const INBOX_CHANNEL: &str = "actix_outbox_inbox";

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

impl Actor for ListenerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let (pool, supervisor, me) = (self.pool.clone(), self.supervisor.clone(), self.me.clone());
        let listen = async move {
            // A connection of its own, outside the pool: when the actor stops, dropping it
            // closes it. A pooled one would go back to the pool still listening, and its
            // notifications would pile up there unread.
            let mut conn = match pool.dedicated_connection().await {
                Ok(c) => c,
                Err(e) => return tracing::warn!(error = %e, "listener could not get a connection"),
            };
            for channel in [OUTBOX_CHANNEL, INBOX_CHANNEL] {
                if let Err(e) = diesel::sql_query(format!("LISTEN {channel}"))
                    .execute(&mut conn)
                    .await
                {
                    return tracing::warn!(error = %e, "LISTEN failed");
                }
            }
            let mut stream = std::pin::pin!(conn.notifications_stream());
            while let Some(n) = stream.next().await {
                let Ok(n) = n else { break };
                let heard = if n.channel == INBOX_CHANNEL {
                    let (from, consumers) = n
                        .payload
                        .split_once('|')
                        .unwrap_or(("", n.payload.as_str()));
                    if from == &*me {
                        continue;
                    }
                    Heard::Inbox(
                        consumers
                            .split(',')
                            .filter(|c| !c.is_empty())
                            .map(str::to_owned)
                            .collect(),
                    )
                } else {
                    Heard::Outbox
                };
                supervisor.do_send(heard);
            }
        };
        // When the connection fails the loop ends and the actor stops; the supervisor starts a
        // new one with a new connection.
        ctx.spawn(listen.into_actor(self).map(|(), _, ctx| ctx.stop()));
    }
}

impl Handler<Stop> for ListenerActor {
    type Result = ();
    fn handle(&mut self, stop: Stop, ctx: &mut Context<Self>) {
        if stop.panic {
            panic!("fault injection: listener panicked");
        }
        ctx.stop();
    }
}
