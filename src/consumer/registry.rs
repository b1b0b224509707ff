//! `ConsumerRegistry`: the in-process transport's delivery side. It knows each consumer's
//! mailbox and, after a claim has written inbox rows, wakes exactly the consumers that got some.

use std::collections::HashMap;

use actix::prelude::*;

use super::actor::ConsumerActor;
use crate::messages::{InboxRowsWritten, Wake};

#[derive(Default)]
pub(crate) struct ConsumerRegistry {
    /// Current mailbox per consumer name; the supervisor replaces an entry after a restart.
    mailboxes: HashMap<String, Addr<ConsumerActor>>,
}

impl Actor for ConsumerRegistry {
    type Context = Context<Self>;
}

/// The supervisor (re)started a consumer actor.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SetMailbox {
    pub consumer: String,
    pub addr: Addr<ConsumerActor>,
}

impl Handler<SetMailbox> for ConsumerRegistry {
    type Result = ();
    fn handle(&mut self, msg: SetMailbox, _: &mut Context<Self>) {
        self.mailboxes.insert(msg.consumer, msg.addr);
    }
}

impl Handler<InboxRowsWritten> for ConsumerRegistry {
    type Result = ();
    fn handle(&mut self, msg: InboxRowsWritten, _: &mut Context<Self>) {
        for (consumer, _) in msg.consumers {
            if let Some(addr) = self.mailboxes.get(&consumer) {
                // A full mailbox already holds a wake-up; a closed one belongs to an actor the
                // supervisor is replacing, and a new actor polls on start. Either way the rows
                // are in the database and nothing is lost by dropping this wake-up.
                let _ = addr.try_send(Wake);
            }
        }
    }
}
