//! What a test reads of the harness, and the pause switch it sets.

use super::cycle::view;
use super::model::*;
use super::Harness;
use crate::error::Result;
use crate::event::EventId;

impl Harness {
    /// Sets a consumer's pause switch: it is delivered nothing until resumed; its rows keep
    /// their state. Publishing and the other consumers carry on.
    ///
    /// # Errors
    /// [`Error::UnknownConsumer`](crate::Error::UnknownConsumer) when no such consumer is registered.
    pub fn pause(&mut self, consumer: &str) -> Result<()> {
        self.set_paused(consumer, true)
    }

    /// Clears a consumer's pause switch; its backlog is delivered by the next cycle.
    ///
    /// # Errors
    /// As [`Harness::pause`].
    pub fn resume(&mut self, consumer: &str) -> Result<()> {
        self.set_paused(consumer, false)
    }

    /// A consumer's inbox rows, in arrival order. Empty for an unknown consumer.
    pub fn inbox(&self, consumer: &str) -> Vec<InboxView> {
        self.inbox
            .iter()
            .filter(|i| i.consumer.as_str() == consumer)
            .map(view)
            .collect()
    }

    /// A consumer's row for one event.
    pub fn row(&self, consumer: &str, event_id: EventId) -> Option<InboxView> {
        self.inbox
            .iter()
            .find(|i| i.consumer.as_str() == consumer && i.row.event_id == event_id.as_uuid())
            .map(view)
    }

    /// The outbox rows, in enqueue order.
    pub fn outbox(&self) -> Vec<OutboxView> {
        self.outbox
            .iter()
            .map(|o| OutboxView {
                event_id: o.event.id,
                event_type: o.event.event_type.clone(),
                status: o.status,
                attempts: o.attempts.max(0) as u32,
                published_at: o.published_at,
            })
            .collect()
    }

    /// How often a consumer's handler actor was rebuilt from its factory because it had
    /// stopped. 0 for an unknown consumer.
    pub fn handler_restarts(&self, consumer: &str) -> u32 {
        self.slot(consumer)
            .map_or(0, |c| self.consumers[c].restarts)
    }

    /// Deliveries of an event a consumer already had that the inbox absorbed
    /// (`DUPLICATE_EVENT`): repeated fan-outs, and redeliveries of finished rows.
    pub fn duplicates(&self, consumer: &str) -> usize {
        self.slot(consumer)
            .map_or(0, |c| self.consumers[c].duplicates)
    }
}
