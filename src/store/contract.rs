//! Statements of the boot-time contract check (`runtime/contract.rs`): what the outbox and the
//! subscriptions hold, and the findings it keeps for health.

use diesel::sql_types::{Array, BigInt, Integer, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;

/// One (event type, version) among the newest `window` outbox events.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub(crate) struct Stored {
    #[diesel(sql_type = Text)]
    pub event_type: String,
    #[diesel(sql_type = Integer)]
    pub event_version: i32,
}

/// The types and versions of the newest `window` outbox events, read backwards along the
/// primary key (UUID v7 ids are time-ordered), so the check costs the same on any table size.
pub(crate) async fn stored(conn: &mut AsyncPgConnection, window: i64) -> Result<Vec<Stored>> {
    let rows = crate::store::sql(
        "SELECT DISTINCT event_type, event_version \
         FROM (SELECT event_type, event_version FROM actix_outbox.outbox_events ORDER BY id DESC LIMIT $1) w \
         ORDER BY 1, 2",
    )
    .bind::<BigInt, _>(window)
    .load(conn)
    .await?;
    Ok(rows)
}

/// A finding, as stored and as health reads it.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName, serde::Serialize, serde::Deserialize)]
pub(crate) struct Finding {
    #[diesel(sql_type = Text)]
    pub code: String,
    /// The consumer it is about, or empty.
    #[diesel(sql_type = Text)]
    pub consumer: String,
    #[diesel(sql_type = Text)]
    pub event_type: String,
    #[diesel(sql_type = Text)]
    pub detail: String,
    #[diesel(sql_type = Text)]
    pub message: String,
}

/// Replaces the findings about `consumers` and about the event types `types` with `found`,
/// in one statement (see the migration `contract_findings`).
pub(crate) async fn replace(
    conn: &mut AsyncPgConnection,
    consumers: &[String],
    types: &[String],
    found: &[Finding],
    by: &str,
) -> Result<()> {
    let col = |f: fn(&Finding) -> &String| found.iter().map(f).cloned().collect::<Vec<_>>();
    crate::store::sql(
        "WITH gone AS (DELETE FROM actix_outbox.contract_findings \
             WHERE consumer = ANY($1) OR (consumer = '' AND event_type = ANY($2))) \
         INSERT INTO actix_outbox.contract_findings (code, consumer, event_type, detail, message, found_by) \
         SELECT * , $8 FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) \
         ON CONFLICT (code, consumer, event_type, detail) DO UPDATE \
             SET message = excluded.message, found_at = now(), found_by = excluded.found_by",
    )
    .bind::<Array<Text>, _>(consumers)
    .bind::<Array<Text>, _>(types)
    .bind::<Array<Text>, _>(col(|f| &f.code))
    .bind::<Array<Text>, _>(col(|f| &f.consumer))
    .bind::<Array<Text>, _>(col(|f| &f.event_type))
    .bind::<Array<Text>, _>(col(|f| &f.detail))
    .bind::<Array<Text>, _>(col(|f| &f.message))
    .bind::<Text, _>(by)
    .execute(conn)
    .await?;
    Ok(())
}

/// Every standing finding, for health.
pub(crate) async fn all(conn: &mut AsyncPgConnection) -> Result<Vec<Finding>> {
    let rows = crate::store::sql(
        "SELECT code, consumer, event_type, detail, message FROM actix_outbox.contract_findings \
         ORDER BY code, consumer, event_type, detail LIMIT 100",
    )
    .load(conn)
    .await?;
    Ok(rows)
}
