//! A TCP proxy on 127.0.0.1 that can black-hole its connections: [`Proxy::freeze`] stops
//! forwarding on every connection open at that moment, both ways, while keeping both sockets
//! open, as a hung middlebox or a path that swallows packets would. Connections made later are
//! forwarded normally. Runs on a thread of its own, so that it keeps going whatever the test's
//! runtime does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// Dropping it stops the proxy and closes every connection.
    _stop: watch::Sender<()>,
}

struct Shared {
    /// Connections are numbered in accept order; those numbered below this are frozen.
    frozen_below: AtomicU64,
    next_id: AtomicU64,
    /// Bumped by [`Proxy::close_frozen`]: frozen connections close both sockets.
    close_frozen: watch::Sender<u64>,
    /// Connections accepted so far.
    accepted: AtomicU64,
}

impl Proxy {
    /// A proxy in front of `upstream` (`host:port`).
    pub fn start(upstream: &str) -> Proxy {
        let upstream = upstream.to_owned();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let (close_frozen, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            frozen_below: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            close_frozen,
            accepted: AtomicU64::new(0),
        });
        let (stop, mut stopped) = watch::channel(());
        let s = shared.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).unwrap();
                loop {
                    tokio::select! {
                        _ = stopped.changed() => return,
                        accepted = listener.accept() => {
                            let Ok((client, _)) = accepted else { continue };
                            let id = s.next_id.fetch_add(1, Ordering::SeqCst);
                            s.accepted.fetch_add(1, Ordering::SeqCst);
                            let (s, upstream, stopped) = (s.clone(), upstream.clone(), stopped.clone());
                            tokio::spawn(async move {
                                if let Ok(server) = TcpStream::connect(&upstream).await {
                                    relay(id, client, server, s, stopped).await;
                                }
                            });
                        }
                    }
                }
            });
        });
        Proxy {
            addr,
            shared,
            _stop: stop,
        }
    }

    /// `url` (`postgres://user@host:port/db?…`) pointed at the proxy.
    pub fn url(&self, url: &str) -> String {
        let scheme_end = url.find("://").map(|i| i + 3).expect("a URL");
        let rest = &url[scheme_end..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let user = authority.rsplit_once('@').map(|(u, _)| u);
        format!(
            "{}{}{}{}",
            &url[..scheme_end],
            user.map(|u| format!("{u}@")).unwrap_or_default(),
            self.addr,
            &rest[authority_end..]
        )
    }

    /// Stops forwarding on every connection open now, both ways, keeping both sockets open.
    /// Returns how many connections that froze (all accepted so far, some perhaps closed).
    pub fn freeze(&self) -> u64 {
        let below = self.shared.next_id.load(Ordering::SeqCst);
        self.shared.frozen_below.store(below, Ordering::SeqCst);
        below
    }

    /// Closes both sockets of every frozen connection (cleanup: the server then ends their
    /// sessions).
    pub fn close_frozen(&self) {
        self.shared.close_frozen.send_modify(|n| *n += 1);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Shared {
    fn frozen(&self, id: u64) -> bool {
        id < self.frozen_below.load(Ordering::SeqCst)
    }
}

async fn relay(
    id: u64,
    client: TcpStream,
    server: TcpStream,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<()>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_r, client_w) = client.into_split();
    let (server_r, server_w) = server.into_split();
    let up = pump(id, client_r, server_w, shared.clone());
    let down = pump(id, server_r, client_w, shared);
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = stopped.changed() => {}
    }
}

/// Copies `from` to `to` until EOF, an error, or a freeze; once frozen, it holds both halves
/// (the sockets stay open, nothing is forwarded) until the frozen connections are closed.
async fn pump(id: u64, mut from: OwnedReadHalf, mut to: OwnedWriteHalf, shared: Arc<Shared>) {
    let mut close = shared.close_frozen.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if shared.frozen(id) {
            break;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    if !shared.frozen(id) {
                        let _ = to.shutdown().await;
                        return;
                    }
                    break;
                }
                Ok(n) => n,
            },
            // Frozen while waiting to read (nothing is forwarded after a freeze, so only the
            // close matters here).
            _ = close.changed() => {
                if shared.frozen(id) {
                    return;
                }
                continue;
            }
        };
        if shared.frozen(id) {
            // Read after the freeze: swallowed.
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    // Frozen: both halves stay open (they are dropped on return) until the frozen
    // connections are closed or the proxy stops.
    let _ = close.changed().await;
    drop((from, to));
}
