//! What a NATS receiver checks against this database: the durable consumers it bound before
//! (`nats_bindings`: one found missing was lost, and is not made anew from the stream's
//! start), and the stream's `max_age` against the retention of processed inbox rows.

use std::time::Duration;

use async_nats::jetstream::stream::RetentionPolicy;

use super::NatsReceiver;
use crate::error::{Error, Result};
use crate::store::{self, PgPool};

/// The error of a receiver whose durable consumer, first bound at `first`, cannot be found.
pub(super) fn lost(
    receiver: &NatsReceiver,
    first: chrono::DateTime<chrono::Utc>,
    e: &dyn std::fmt::Display,
) -> Error {
    let cfg = &receiver.config;
    Error::NatsConsumerLost(format!(
        "{}: the durable consumer, which this database first bound at {first}, cannot be found \
         ({e}). It is not recreated from the stream's start: the events whose processed inbox \
         rows retention deleted would be applied again. Recreate it from where this database \
         stopped (`nats consumer add {} {} --deliver <time or sequence>`), or delete its row \
         in actix_outbox.nats_bindings to have it recreated from the stream's start",
        receiver.name(),
        cfg.stream.name,
        cfg.durable
    ))
}

/// The durable consumer this database bound at `first`: lost only when the server says it is
/// not there; a timeout or an unreachable server is an error like any other, tried again.
pub(super) async fn found(
    receiver: &NatsReceiver,
    stream: &async_nats::jetstream::stream::Stream,
    first: chrono::DateTime<chrono::Utc>,
) -> Result<async_nats::jetstream::consumer::PullConsumer> {
    use async_nats::jetstream::context::ConsumerInfoErrorKind::NotFound;
    let durable = &receiver.config.durable;
    match stream.get_consumer(durable).await {
        Ok(consumer) => Ok(consumer),
        Err(e) => match stream.consumer_info(durable).await {
            Err(info) if info.kind() == NotFound => Err(lost(receiver, first, &info)),
            _ => Err(Error::Config(format!("NATS consumer {durable}: {e}"))),
        },
    }
}

impl NatsReceiver {
    /// Refuses a stream that keeps messages longer than the runtime keeps processed inbox
    /// rows (`processed_after`, when retention is on): a message delivered again after its
    /// row was deleted (a durable consumer recreated, a redelivery past the window) would be
    /// recorded as new and applied a second time. A stream that deletes what is acknowledged
    /// (work-queue or interest retention) delivers nothing again, and passes.
    pub(crate) fn check_retention(&self, processed_after: Option<Duration>) -> Result<()> {
        let stream = &self.config.stream;
        let Some(kept) = processed_after else {
            return Ok(());
        };
        if stream.retention != RetentionPolicy::Limits
            || (!stream.max_age.is_zero() && stream.max_age <= kept)
        {
            return Ok(());
        }
        let age = if stream.max_age.is_zero() {
            "for ever".to_owned()
        } else {
            format!("{:?}", stream.max_age)
        };
        Err(Error::Config(format!(
            "{}: the stream keeps messages {age}, longer than retention keeps processed inbox \
             rows ({kept:?}); a message delivered again after its row was deleted would be \
             applied twice. Set NatsStream::max_age to at most {kept:?}, or keep processed \
             rows longer (RetentionConfig::processed_inbox_after)",
            self.name()
        )))
    }
}

/// When this database first bound the receiver's durable consumer, if it ever did.
pub(super) async fn bound_before(
    pool: &PgPool,
    stream: &str,
    durable: &str,
) -> Result<Option<chrono::DateTime<chrono::Utc>>> {
    #[derive(diesel::QueryableByName)]
    struct First {
        #[diesel(sql_type = diesel::sql_types::Timestamptz)]
        first_bound_at: chrono::DateTime<chrono::Utc>,
    }
    let mut conn = pool.get().await?;
    let first: Vec<First> = store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
        let q = crate::store::sql(
            "SELECT first_bound_at FROM actix_outbox.nats_bindings \
             WHERE stream = $1 AND durable = $2",
        )
        .bind::<diesel::sql_types::Text, _>(stream)
        .bind::<diesel::sql_types::Text, _>(durable);
        Ok(diesel_async::RunQueryDsl::load(q, c).await?)
    })
    .await?;
    Ok(first.into_iter().next().map(|f| f.first_bound_at))
}

/// Records that this database bound the receiver's durable consumer (once).
pub(super) async fn record(pool: &PgPool, stream: &str, durable: &str) -> Result<()> {
    let mut conn = pool.get().await?;
    store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
        let q = crate::store::sql(
            "INSERT INTO actix_outbox.nats_bindings (stream, durable) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING",
        )
        .bind::<diesel::sql_types::Text, _>(stream)
        .bind::<diesel::sql_types::Text, _>(durable);
        diesel_async::RunQueryDsl::execute(q, c).await?;
        Ok(())
    })
    .await
}
