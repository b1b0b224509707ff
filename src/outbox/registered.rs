//! Enqueueing through an [`EventRegistry`]: every event validated against its registered
//! type before the one statement that writes them. Here rather than beside the registry,
//! because writing the outbox is this module's business; the registry only judges events.

use diesel::pg::Pg;
use diesel::query_builder::QueryFragment;
use diesel_async::AsyncPgConnection;

use crate::error::Result;
use crate::event::{EventId, EventRegistry, NewEvent};

impl EventRegistry {
    /// Validates and writes one event in the caller's transaction.
    ///
    /// # Errors
    /// As [`EventRegistry::validate`], and [`Error::Database`](crate::Error::Database) when the insert fails.
    pub async fn enqueue(&self, conn: &AsyncPgConnection, event: &NewEvent) -> Result<EventId> {
        self.validate(event)?;
        super::insert_validated(conn, std::slice::from_ref(event)).await?;
        Ok(event.id)
    }

    /// Validates every event, then writes all of them with one statement.
    ///
    /// # Errors
    /// As [`EventRegistry::enqueue`]; nothing is written unless every event is valid.
    pub async fn enqueue_many(
        &self,
        conn: &AsyncPgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<EventId>> {
        events.iter().try_for_each(|e| self.validate(e))?;
        super::insert_validated(conn, events).await?;
        Ok(events.iter().map(|e| e.id).collect())
    }

    /// Validates every event, then runs `business` and writes them in one statement, as
    /// [`enqueue_with`](crate::enqueue_with) does (and with the same `RETURNING` rule).
    ///
    /// # Errors
    /// As [`EventRegistry::enqueue_many`].
    pub async fn enqueue_with<B>(
        &self,
        conn: &AsyncPgConnection,
        business: B,
        events: &[NewEvent],
    ) -> Result<bool>
    where
        B: QueryFragment<Pg> + Send,
    {
        events.iter().try_for_each(|e| self.validate(e))?;
        super::insert_validated_with(conn, business, events).await
    }
}
