//! Sessions holding a snapshot open, for the health check (`LONG_SNAPSHOT`).

use std::time::Duration;

use diesel::sql_types::{BigInt, Double, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::store;

/// A client session of the database holding a snapshot or a transaction id open
/// (`backend_xmin` or `backend_xid` set: a session idle in a transaction that wrote holds the
/// horizon too), whoever owns it; vacuum's own sessions are not counted:
/// while it does, vacuum removes no row of any table that died after it began, and every
/// claim walks the dead index entries the backlog leaves (issue 30 measured a drain falling
/// from 1,124 to 99 events/s behind one). Without `pg_read_all_stats` (or `pg_monitor`), the
/// role sees only its own sessions' details.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, QueryableByName)]
pub(crate) struct HeldSnapshot {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pub pid: i32,
    #[diesel(sql_type = Text)]
    pub application: String,
    #[diesel(sql_type = Text)]
    pub state: String,
    /// Since its transaction began: a snapshot is at most that old.
    #[diesel(sql_type = Double)]
    pub age_seconds: f64,
    /// The head of its current (or last) statement.
    #[diesel(sql_type = Text)]
    pub query: String,
}

/// The sessions of this database (this one aside) whose transaction holding a snapshot began
/// more than `floor` ago, oldest first, at most five.
pub(crate) async fn held(
    conn: &mut AsyncPgConnection,
    floor: Duration,
) -> Result<Vec<HeldSnapshot>> {
    let rows = crate::store::sql(
        "SELECT pid, coalesce(application_name, '') AS application, coalesce(state, '') AS state, \
             extract(epoch FROM now() - xact_start)::float8 AS age_seconds, \
             left(regexp_replace(coalesce(query, ''), '\\s+', ' ', 'g'), 120) AS query \
         FROM pg_stat_activity \
         WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) \
           AND backend_type = 'client backend' AND datname = current_database() \
           AND pid <> pg_backend_pid() \
           AND xact_start < now() - $1 * interval '1 millisecond' \
         ORDER BY xact_start LIMIT 5",
    )
    .bind::<BigInt, _>(store::millis(floor))
    .load(conn)
    .await?;
    Ok(rows)
}
