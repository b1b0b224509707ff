//! Just enough of the W3C WebDriver protocol to drive headless Chromium through chromedriver:
//! plain HTTP/1.1 over a tokio socket, so the test needs no client library and never blocks
//! the actix runtime that serves the page under test.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The key under which WebDriver returns an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Chromium and chromedriver, from `AO_CHROMIUM` / `AO_CHROMEDRIVER` or the `PATH`.
pub fn find_browser() -> Result<(PathBuf, PathBuf), String> {
    let chromium = from_env_or_path(
        "AO_CHROMIUM",
        &["chromium", "chromium-browser", "google-chrome"],
    )
    .ok_or("no chromium binary found (looked for chromium, chromium-browser, google-chrome)")?;
    let driver = from_env_or_path("AO_CHROMEDRIVER", &["chromedriver"])
        .ok_or("no chromedriver binary found")?;
    Ok((chromium, driver))
}

fn from_env_or_path(var: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var).map(PathBuf::from) {
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file())
}

/// A chromedriver process with one browser session. Dropping it kills the chromedriver
/// process this test started (and with it the browser).
pub struct Driver {
    child: Child,
    port: u16,
    session: String,
    profile: PathBuf,
}

impl Driver {
    /// Starts chromedriver on a free port and opens a headless session with a fresh profile.
    pub async fn start(chromium: &Path, chromedriver: &Path, scratch: &Path) -> Driver {
        let port = free_port();
        let child = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromedriver.display()));
        let profile = scratch.join(format!(
            "chromium-profile-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&profile).unwrap();
        let mut driver = Driver {
            child,
            port,
            session: String::new(),
            profile,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((200, v)) = driver.http("GET", "/status", None).await {
                if v["value"]["ready"] == true {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver did not become ready"
            );
            actix_rt::time::sleep(Duration::from_millis(100)).await;
        }
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1280,1100",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--user-data-dir={}", driver.profile.display())])
        .collect::<Vec<_>>();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium.display().to_string(), "args": args},
        }}});
        let (status, v) = driver.http("POST", "/session", Some(caps)).await.unwrap();
        assert_eq!(status, 200, "new session: {v}");
        driver.session = v["value"]["sessionId"].as_str().unwrap().to_owned();
        driver
    }

    async fn http(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> std::io::Result<(u16, Value)> {
        let request = async {
            let mut stream = TcpStream::connect(("127.0.0.1", self.port)).await?;
            let body = body.map(|b| b.to_string()).unwrap_or_default();
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                self.port,
                body.len()
            );
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(body.as_bytes()).await?;
            // chromedriver keeps the connection open despite `Connection: close`, so the
            // response ends where its Content-Length (or last chunk) says, not at EOF.
            let mut raw = Vec::new();
            let mut chunk = [0u8; 16 * 1024];
            loop {
                if let Some(done) = complete(&raw) {
                    raw.truncate(done);
                    break;
                }
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    break;
                }
                raw.extend_from_slice(&chunk[..n]);
            }
            Ok::<_, std::io::Error>(raw)
        };
        let raw = actix_rt::time::timeout(Duration::from_secs(60), request)
            .await
            .map_err(|_| std::io::Error::other("webdriver request timed out"))??;
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| std::io::Error::other("no HTTP header end"))?;
        let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut body = raw[split + 4..].to_vec();
        if head.contains("transfer-encoding:") && head.contains("chunked") {
            body = dechunk(&body);
        }
        let value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Ok((status, value))
    }

    async fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let full = format!("/session/{}{path}", self.session);
        let (status, v) = self
            .http(method, &full, body)
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        assert_eq!(status, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    pub async fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url }))).await;
    }

    /// The first element matching `css`, if there is one now.
    pub async fn find(&self, css: &str) -> Option<String> {
        let full = format!("/session/{}/element", self.session);
        let body = json!({"using": "css selector", "value": css});
        match self.http("POST", &full, Some(body)).await {
            Ok((200, v)) => v["value"][ELEMENT].as_str().map(str::to_owned),
            _ => None,
        }
    }

    /// Polls for an element matching `css` until `timeout`.
    pub async fn wait_for(&self, css: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.find(css).await {
                return e;
            }
            if Instant::now() > deadline {
                let body = self.script("return document.body.innerText").await;
                panic!("no element {css} within {timeout:?}; the page shows:\n{body}");
            }
            actix_rt::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls the element matching `css` until its text contains `want`, and returns the text.
    pub async fn wait_for_text(&self, css: &str, want: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        let mut shown = None;
        loop {
            if let Some(e) = self.find(css).await {
                let text = self.text(&e).await;
                if text.contains(want) {
                    return text;
                }
                shown = Some(text);
            }
            if Instant::now() > deadline {
                panic!("{css} does not show {want:?} within {timeout:?}; it shows {shown:?}");
            }
            actix_rt::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn click(&self, element: &str) {
        self.cmd(
            "POST",
            &format!("/element/{element}/click"),
            Some(json!({})),
        )
        .await;
    }

    pub async fn type_text(&self, element: &str, text: &str) {
        self.cmd(
            "POST",
            &format!("/element/{element}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    pub async fn text(&self, element: &str) -> String {
        self.cmd("GET", &format!("/element/{element}/text"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Runs `body` as a function in the page and returns its result as text.
    pub async fn script(&self, body: &str) -> String {
        let v = self
            .cmd(
                "POST",
                "/execute/sync",
                Some(json!({"script": body, "args": []})),
            )
            .await;
        match v {
            Value::String(s) => s,
            other => other.to_string(),
        }
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        let v = self.cmd("GET", "/screenshot", None).await;
        base64_decode(v.as_str().unwrap_or_default())
    }

    /// Ends the session (closing the browser) and stops chromedriver.
    pub async fn quit(mut self) {
        let full = format!("/session/{}", self.session);
        let _ = self.http("DELETE", &full, None).await;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // Only the chromedriver this test started, by its handle; a no-op after `quit`.
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// The length of a complete response in `raw`, once it has arrived.
fn complete(raw: &[u8]) -> Option<usize> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let length = head.lines().find_map(|l| {
        l.strip_prefix("content-length:")
            .and_then(|v| v.trim().parse::<usize>().ok())
    });
    match length {
        Some(n) => (raw.len() >= split + n).then_some(split + n),
        None if head.contains("chunked") => raw
            .windows(5)
            .rposition(|w| w == b"0\r\n\r\n")
            .map(|i| i + 5),
        None => None,
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free local port")
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = body.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = std::str::from_utf8(&body[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .unwrap_or(0);
        if size == 0 || body.len() < eol + 2 + size {
            return out;
        }
        out.extend_from_slice(&body[eol + 2..eol + 2 + size]);
        body = &body[(eol + 4 + size).min(body.len())..];
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for v in s.bytes().filter_map(val) {
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}
