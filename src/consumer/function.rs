//! Consumers written as plain async functions ([`OutboxBuilder::consumer_fn`](crate::OutboxBuilder::consumer_fn)):
//! an actor that holds the function and calls it with each delivery (or batch). For handlers
//! that keep no state between events; one that does is an actor of its own.

use std::future::Future;

use actix::prelude::*;

use super::{Delivery, DeliveryBatch, HandlerError};

/// The actor behind a function consumer, for `Delivery` and `DeliveryBatch` functions alike.
/// Rebuilt from a clone of the function, like any handler actor, should it stop. Boxed: an
/// actor must be `Unpin`, a closure need not be.
pub(crate) struct FnConsumer<F>(pub Box<F>);

impl<F: 'static> Actor for FnConsumer<F> {
    type Context = Context<Self>;
}

impl<F, Fut> Handler<Delivery> for FnConsumer<F>
where
    F: Fn(Delivery) -> Fut + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + 'static,
{
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, delivery: Delivery, _: &mut Context<Self>) -> Self::Result {
        Box::pin((self.0)(delivery))
    }
}

impl<F, Fut> Handler<DeliveryBatch> for FnConsumer<F>
where
    F: Fn(DeliveryBatch) -> Fut + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + 'static,
{
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, batch: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        Box::pin((self.0)(batch))
    }
}
