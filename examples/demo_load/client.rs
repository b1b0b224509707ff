//! Just enough HTTP/1.1 for the driver: one keep-alive connection over a tokio socket,
//! reopened after any transport error, JSON in and out. The order service is the only server
//! it talks to, so no client library is needed.

use std::io;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A response head and body.
pub struct Response {
    pub status: u16,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as `T`, or a message naming what came instead.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, String> {
        serde_json::from_slice(&self.body)
            .map_err(|e| format!("unexpected body ({e}): {}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub struct Client {
    /// `host:port`, for the socket and the Host header.
    authority: String,
    timeout: Duration,
    conn: Option<BufReader<TcpStream>>,
}

impl Client {
    /// A client of `base` (`http://host:port`, any path ignored); `timeout` bounds each request,
    /// connecting included.
    pub fn new(base: &str, timeout: Duration) -> Result<Client, String> {
        let rest = base
            .strip_prefix("http://")
            .ok_or_else(|| format!("{base:?} is not an http:// URL"))?;
        let authority = rest.split('/').next().unwrap_or_default();
        if authority.is_empty() {
            return Err(format!("{base:?} names no host"));
        }
        Ok(Client {
            authority: authority.to_owned(),
            timeout,
            conn: None,
        })
    }

    pub async fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> io::Result<Response> {
        self.request("GET", path, None::<&()>, headers).await
    }

    pub async fn post(
        &mut self,
        path: &str,
        body: &impl Serialize,
        headers: &[(&str, &str)],
    ) -> io::Result<Response> {
        self.request("POST", path, Some(body), headers).await
    }

    /// One request. Any error (timeouts included) closes the connection, so the next request
    /// starts on a fresh one.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&impl Serialize>,
        headers: &[(&str, &str)],
    ) -> io::Result<Response> {
        let body = match body {
            Some(b) => Some(serde_json::to_vec(b)?),
            None => None,
        };
        let result = tokio::time::timeout(
            self.timeout,
            self.exchange(method, path, body.as_deref(), headers),
        )
        .await
        .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "request timed out")));
        match result {
            Ok((resp, keep_alive)) => {
                if !keep_alive {
                    self.conn = None;
                }
                Ok(resp)
            }
            Err(e) => {
                self.conn = None;
                Err(e)
            }
        }
    }

    async fn exchange(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
    ) -> io::Result<(Response, bool)> {
        if self.conn.is_none() {
            let stream = TcpStream::connect(self.authority.as_str()).await?;
            stream.set_nodelay(true)?;
            self.conn = Some(BufReader::new(stream));
        }
        let conn = self.conn.as_mut().expect("connected above");

        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.authority);
        if let Some(body) = body {
            head.push_str("Content-Type: application/json\r\n");
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut request = head.into_bytes();
        request.extend_from_slice(body.unwrap_or_default());
        conn.get_mut().write_all(&request).await?;

        let status_line = read_line(conn).await?;
        // "HTTP/1.1 201 Created"
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or_default();
        let status = parts
            .next()
            .and_then(|s| s.parse::<u16>().ok())
            .filter(|_| version.starts_with("HTTP/1."))
            .ok_or_else(|| bad(format!("bad status line {status_line:?}")))?;
        let mut headers = Vec::new();
        loop {
            let line = read_line(conn).await?;
            if line.is_empty() {
                break;
            }
            let (name, value) = line
                .split_once(':')
                .ok_or_else(|| bad(format!("bad header line {line:?}")))?;
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
        let resp_header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let chunked = resp_header("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let length = resp_header("content-length")
            .map(|v| v.parse::<usize>())
            .transpose()
            .map_err(|_| bad("bad Content-Length".into()))?;
        let mut keep_alive = !resp_header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
            && version == "HTTP/1.1";

        let mut body = Vec::new();
        if method == "HEAD" || status == 204 || status == 304 || (100..200).contains(&status) {
            // No body.
        } else if chunked {
            loop {
                let size_line = read_line(conn).await?;
                let size =
                    usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                        .map_err(|_| bad(format!("bad chunk size {size_line:?}")))?;
                if size == 0 {
                    // Trailers, up to the empty line.
                    while !read_line(conn).await?.is_empty() {}
                    break;
                }
                let start = body.len();
                body.resize(start + size, 0);
                conn.read_exact(&mut body[start..]).await?;
                read_line(conn).await?;
            }
        } else if let Some(length) = length {
            body.resize(length, 0);
            conn.read_exact(&mut body).await?;
        } else {
            conn.read_to_end(&mut body).await?;
            keep_alive = false;
        }
        Ok((
            Response {
                status,
                headers,
                body,
            },
            keep_alive,
        ))
    }
}

/// A line without its CRLF; the connection closing first is an error.
async fn read_line(conn: &mut BufReader<TcpStream>) -> io::Result<String> {
    let mut line = Vec::new();
    if conn.read_until(b'\n', &mut line).await? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the server closed the connection",
        ));
    }
    while matches!(line.last(), Some(b'\n' | b'\r')) {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| bad("a header line is not UTF-8".into()))
}

fn bad(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}
