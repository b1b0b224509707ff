//! The audit trail (`admin_audit`): one row per operator action, written in the action's own
//! transaction. Not behind the `admin` feature: actions taken in code (a replay) are audited
//! too.

use diesel::sql_types::{BigInt, Jsonb, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;

/// Writes one audit row in the caller's transaction; returns its id.
pub(crate) async fn insert_audit(
    conn: &mut AsyncPgConnection,
    who: &str,
    action: &str,
    target: &str,
    reason: Option<&str>,
    details: &serde_json::Value,
) -> Result<i64> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let row: Id = crate::store::sql(
        "INSERT INTO actix_outbox.admin_audit (who, action, target, reason, details) \
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind::<Text, _>(who)
    .bind::<Text, _>(action)
    .bind::<Text, _>(target)
    .bind::<Nullable<Text>, _>(reason)
    .bind::<Jsonb, _>(details)
    .get_result(conn)
    .await?;
    Ok(row.id)
}
