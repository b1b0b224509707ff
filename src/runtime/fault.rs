//! Fault injection (feature `testing`): the supervisor stops a chosen child, or makes it
//! panic, so that the tests exercise its restart.

use actix::prelude::*;

use super::supervisor::SupervisorActor;
use crate::messages::Stop;

/// Which child a fault-injection `Stop` goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Child {
    Publisher,
    Registry,
    Reconciler,
    Consumer(String),
}

#[derive(Message)]
#[rtype(result = "bool")]
pub(crate) struct StopChild {
    pub child: Child,
    pub panic: bool,
}

impl Handler<StopChild> for SupervisorActor {
    type Result = bool;
    fn handle(&mut self, msg: StopChild, _: &mut Context<Self>) -> bool {
        let stop = Stop { panic: msg.panic };
        let sent = match &msg.child {
            Child::Publisher => self.publisher.as_ref().map(|a| a.try_send(stop)),
            Child::Registry => self.registry.as_ref().map(|a| a.try_send(stop)),
            Child::Reconciler => self.reconciler.as_ref().map(|a| a.try_send(stop)),
            Child::Consumer(name) => self
                .consumers
                .iter()
                .find(|s| s.cfg.name.as_str() == name)
                .and_then(|s| s.addr.as_ref())
                .map(|a| a.try_send(stop)),
        };
        matches!(sent, Some(Ok(())))
    }
}
