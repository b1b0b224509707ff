//! One attempt in a real transaction ([`Harness::with_database`](super::Harness::with_database)):
//! a connection of the test's pool, `BEGIN`, lent to the handler as the runtime lends it
//! (`consumer::lend::hand_over`, the same code), taken back, then `COMMIT` or `ROLLBACK`.
//!
//! The inbox and outbox stay in the harness's memory; the transaction holds only what the
//! handler writes through its delivery, so that a failed or crashed attempt undoes exactly what
//! the runtime's rollback undoes.

use diesel::sql_types::BigInt;
use diesel::QueryableByName;
use diesel_async::TransactionManager;
use diesel_async::{AnsiTransactionManager as Tm, AsyncPgConnection, RunQueryDsl};

use crate::consumer::actor::HandlerRef;
use crate::consumer::{hand_over, ConsumerConfig, DeliveryMode, HandlerError};
use crate::error::Error;
use crate::store::inbox::InboxRow;
use crate::store::{self, OwnedConn, PgPool, DB_TIMEOUT};

/// How one call of the handler went, with the transaction it ran in.
pub(super) struct Called {
    /// The handler's result, or why the attempt failed around it (a kept connection, a
    /// transaction that could not commit, the database).
    pub(super) result: Result<(), HandlerError>,
    /// The handler actor stopped during the call.
    pub(super) lost: bool,
    /// The handler was called (not when no transaction could be opened).
    pub(super) ran: bool,
}

/// Runs the handler on `row` in a transaction of its own. The transaction commits only when
/// `commit` is set and the handler returned `Ok` with the connection back as it was lent;
/// otherwise it rolls back and the result says why.
pub(super) async fn call(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    row: InboxRow,
    commit: bool,
) -> Called {
    let mut conn: OwnedConn = match pool.get_owned().await {
        Ok(conn) => conn,
        Err(e) => return not_run(Error::from(e)),
    };
    let begun = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
        Tm::begin_transaction(c).await?;
        transaction_id(c).await
    })
    .await;
    let xid = match begun {
        Ok(xid) => xid,
        Err(e) => {
            store::poison(&mut conn);
            return not_run(e);
        }
    };
    let mut rows = [row];
    let call = hand_over(cfg, handler, conn, &mut rows, 1, DeliveryMode::Live).await;
    let Some(mut conn) = call.conn else {
        // The handler still holds the connection, or handed it back at another depth (and
        // `hand_over` dropped it). Either way its transaction can never commit: the pool
        // closes a connection returned inside a transaction, and PostgreSQL rolls it back.
        let why = if call.held {
            "the handler returned but kept its connection"
        } else {
            "the handler left the delivery's transaction at another depth (a transaction of \
             its own left open, or the delivery's ended)"
        };
        return Called {
            result: call.result.and(Err(HandlerError::retry(why))),
            lost: call.lost,
            ran: true,
        };
    };
    let mut result = call.result;
    if result.is_ok() && commit {
        result = commit_own(&mut conn, xid).await;
        if result.is_ok() {
            return Called {
                result,
                lost: call.lost,
                ran: true,
            };
        }
    }
    roll_back(&mut conn).await;
    Called {
        result,
        lost: call.lost,
        ran: true,
    }
}

/// Commits the delivery's transaction, having checked that it is still the one that was lent
/// (a handler may have run `COMMIT` or `ROLLBACK` itself, which diesel's depth does not see)
/// and that it can commit (a handler may have swallowed a failed statement).
async fn commit_own(conn: &mut OwnedConn, lent: i64) -> Result<(), HandlerError> {
    match store::bounded(conn, DB_TIMEOUT, async |c| transaction_id(c).await).await {
        Ok(xid) if xid == lent => {}
        Ok(_) => {
            return Err(HandlerError::retry(
                "the handler ended the delivery's transaction itself (a COMMIT or ROLLBACK of \
                 its own): what it wrote is not the delivery's",
            ))
        }
        Err(e) => {
            return Err(HandlerError::retry(format!(
                "the handler returned Ok, but a statement of its transaction had failed, so it \
                 could not commit: {e}"
            )))
        }
    }
    store::bounded(conn, DB_TIMEOUT, async |c| {
        Ok(Tm::commit_transaction(c).await?)
    })
    .await
    .map_err(|e| HandlerError::retry(format!("the delivery's transaction did not commit: {e}")))
}

/// Rolls the delivery's transaction back; a connection that cannot is closed instead (the pool
/// drops it, PostgreSQL rolls back), so the next attempt never inherits it.
async fn roll_back(conn: &mut OwnedConn) {
    let open = Tm::transaction_manager_status_mut(&mut **conn)
        .transaction_depth()
        .map_or(true, |d| d.is_some());
    if !open {
        return;
    }
    let rolled = store::bounded(conn, DB_TIMEOUT, async |c| {
        Ok(Tm::rollback_transaction(c).await?)
    })
    .await;
    if rolled.is_err() {
        store::poison(conn);
    }
}

#[derive(QueryableByName)]
struct Xid {
    #[diesel(sql_type = BigInt)]
    xid: i64,
}

/// The id of the transaction running on `conn` (assigned by this call if it had none).
async fn transaction_id(conn: &mut AsyncPgConnection) -> crate::Result<i64> {
    let row: Xid = crate::store::sql("SELECT txid_current() AS xid")
        .get_result(conn)
        .await?;
    Ok(row.xid)
}

/// An attempt that failed before its handler was called: the harness's database did.
fn not_run(e: Error) -> Called {
    Called {
        result: Err(HandlerError::from(e)),
        lost: false,
        ran: false,
    }
}
