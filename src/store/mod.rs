//! The database seam: every SQL statement the runtime runs lives in this folder, so the state
//! machines of ARCHITECTURE §4 can be read in one place. Internal; users see only [`PgPool`].

pub(crate) mod admin;
pub(crate) mod inbox;
pub(crate) mod lease;
pub(crate) mod migrate;
pub(crate) mod outbox;
pub(crate) mod stats;
pub(crate) mod timeline;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::QueryResult;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::AsyncPgConnection;

/// The connection pool the runtime and the application share.
pub type PgPool = bb8::Pool<AsyncDieselConnectionManager<AsyncPgConnection>>;

/// A pooled connection that can move into an actor message (`Pool::get_owned`).
pub(crate) type OwnedConn =
    bb8::PooledConnection<'static, AsyncDieselConnectionManager<AsyncPgConnection>>;

/// Builds a pool for `database_url` with `max_size` connections; a convenience for
/// applications that do not configure bb8 themselves. Connections are not tested on
/// check-out (bb8's default costs a round trip each time); build your own pool the same way.
pub async fn connect(database_url: &str, max_size: u32) -> crate::Result<PgPool> {
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(database_url);
    bb8::Pool::builder()
        .max_size(max_size)
        // A `SELECT 1` per check-out is a round trip per batch and per claim; a broken
        // connection fails its first statement instead, and the caller retries.
        .test_on_check_out(false)
        .build(manager)
        .await
        .map_err(|e| crate::Error::Pool(e.to_string()))
}

/// A raw statement whose SQL text never changes, so diesel-async may keep its prepared
/// statement per connection. `sql_query` alone is never cached (its SQL could be built at run
/// time), which costs a prepare round trip on every execution; every statement in this folder
/// is a constant string with bind parameters, so it is safe to cache by its text.
#[derive(Debug, Clone)]
pub(crate) struct Cached<Q>(pub Q);

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for Cached<Q> {
    fn walk_ast<'b>(&'b self, pass: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.0.walk_ast(pass)
    }

    fn is_safe_to_cache_prepared(&self, _backend: &Pg) -> QueryResult<bool> {
        Ok(true)
    }
}

impl<Q> QueryId for Cached<Q> {
    type QueryId = ();
    // Cached by SQL text, not by type: one wrapper type serves many statements.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q: Query> Query for Cached<Q> {
    type SqlType = Q::SqlType;
}
