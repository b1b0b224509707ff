// The quick start: an order is completed, and its notification is delivered exactly once.
// Run it against a database of your own, where it creates two small tables:
//     DATABASE_URL=postgres://localhost/quickstart cargo run --example quickstart
use actix::prelude::*;
use actix_outbox::{enqueue, ConsumerConfig, Delivery, HandlerError, NewEvent, OutboxRuntime};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use serde_json::json;

/// The consumer: an ordinary actix actor that handles `Delivery` messages.
struct Notifier {
    handled: tokio::sync::mpsc::UnboundedSender<String>, // tells this example when to stop
}

impl Actor for Notifier {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Notifier {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let handled = self.handled.clone();
        Box::pin(async move {
            let mut conn = d.conn().await?; // the open inbox transaction
            actix_outbox::db::Prepared(
                // a constant statement: prepared once per connection
                diesel::sql_query("INSERT INTO notifications (order_id) VALUES ($1)")
                    .bind::<diesel::sql_types::Text, _>(d.aggregate_id()),
            )
            .execute(&mut *conn)
            .await?; // commits together with the event's PROCESSED mark
            let order = d.aggregate_id();
            println!("notification: {} of order {order} handled", d.event_type());
            let _ = handled.send(order.to_owned());
            Ok(())
        })
    }
}

#[actix_web::main]
async fn main() -> actix_outbox::Result<()> {
    let url = std::env::var("DATABASE_URL").expect("set DATABASE_URL to a PostgreSQL database");
    actix_outbox::migrate(&url).await?; // the library's tables
    let pool = actix_outbox::connect(&url, 4).await?; // the application's pool
    let app_tables = "CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, status text);
        CREATE TABLE IF NOT EXISTS notifications (order_id text NOT NULL);
        INSERT INTO orders VALUES ('o1', 'PLACED') ON CONFLICT (id) DO NOTHING;";
    pool.get().await?.batch_execute(app_tables).await?;

    let (handled, mut handled_rx) = tokio::sync::mpsc::unbounded_channel();
    let runtime = OutboxRuntime::builder(actix_outbox::connect(&url, 8).await?) // a pool of its own
        .consumer(
            ConsumerConfig::new("notification").subscribe("ORDER_COMPLETED"),
            move || Notifier {
                handled: handled.clone(),
            },
        )
        .start()
        .await?;
    let outbox = runtime.handle(); // Clone + Send: give it to your request handlers

    // What a request handler does: the business change and its event, in one transaction.
    let mut conn = pool.get().await?;
    conn.transaction::<_, actix_outbox::Error, _>(async |conn| {
        diesel::sql_query("UPDATE orders SET status = 'COMPLETED' WHERE id = 'o1'")
            .execute(conn)
            .await?;
        let payload = json!({ "order_id": "o1" });
        let event = NewEvent::new("ORDER_COMPLETED", "order", "o1", payload);
        enqueue(conn, &event).await?;
        Ok(())
    })
    .await?;
    println!("order o1: COMPLETED, and its event committed with it");
    outbox.wake(); // deliver now rather than at the next poll

    // A service would keep serving; this example waits for the delivery, then stops.
    let wait = std::time::Duration::from_secs(10);
    let delivered = tokio::time::timeout(wait, handled_rx.recv()).await;
    runtime.shutdown().await; // the batch in flight commits first: effect and mark together
    let order = delivered.ok().flatten().expect("no delivery within 10 s");
    println!("order {order}: notification delivered; shut down cleanly");
    Ok(())
}

// ---- end of the quick start ----------------------------------------------------------------
// README.md shows everything above this line as its quick start. The check below fails the
// build of this example (`cargo build --examples`, `cargo test`, clippy) when the README's copy
// differs from this file, so the two cannot drift apart.

const _: () = assert!(
    shows(
        include_bytes!("../README.md"),
        include_bytes!("quickstart.rs"),
        b"\n// ---- end of the quick start",
    ),
    "README.md's quick start must be examples/quickstart.rs up to its end marker, verbatim"
);

/// Whether `readme` contains `file` up to (and including the newline before) `marker`.
const fn shows(readme: &[u8], file: &[u8], marker: &[u8]) -> bool {
    match find(file, marker) {
        Some(end) => find(readme, file.split_at(end + 1).0).is_some(),
        None => false,
    }
}

/// The first position of `needle` in `hay`.
const fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + needle.len() <= hay.len() {
        let mut j = 0;
        while j < needle.len() && hay[i + j] == needle[j] {
            j += 1;
        }
        if j == needle.len() {
            return Some(i);
        }
        i += 1;
    }
    None
}
