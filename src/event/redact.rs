//! Error text as it may be stored and logged. A handler's or a transport's error message often
//! quotes what it was given (a connection string, a request, a response body), and a
//! `last_error` column outlives it, readable by every operator: [`default_redactor`] blanks
//! what looks like a secret or an e-mail address before the text is written, and an
//! application replaces it with
//! [`RuntimeConfig::redact_errors`](crate::RuntimeConfig::redact_errors).

use std::fmt;
use std::sync::Arc;

use super::PayloadRules;

/// What takes the place of a redacted value.
pub(crate) const REDACTED: &str = "[redacted]";

/// A value after `Bearer`/`Basic` shorter than this, of letters only and lower case but for
/// its first, is a word of the sentence ("invalid Bearer token"), not a credential.
const WORD_MAX: usize = 20;
/// The shortest opaque token: shorter runs are ids, codes and names.
const TOKEN_MIN: usize = 32;
/// A token has a piece this long with no separator in it (`/`, `_`, `-`, …): a path or a
/// `SCREAMING_SNAKE` name of that length has shorter pieces, and so has a UUID.
const TOKEN_PIECE_MIN: usize = 16;

/// The redaction the runtime applies to error text before it stores or logs it, unless the
/// application sets its own with
/// [`RuntimeConfig::redact_errors`](crate::RuntimeConfig::redact_errors). Each of these is
/// replaced by `[redacted]`:
///
/// - the password of a URL (`postgres://app:[redacted]@db/orders`);
/// - the credentials after `Bearer` or `Basic`;
/// - the value of a `key=value`, `key: value` or JSON `"key": "value"` pair whose key looks
///   sensitive, by the whole-word matching and the list of
///   [`DEFAULT_SENSITIVE_KEYS`](crate::event::DEFAULT_SENSITIVE_KEYS) (`password`, `api_key`,
///   `token`, `email`, …);
/// - an e-mail address;
/// - a JWT (`eyJ….….…`), and any other opaque token: a run of 32 or more base64 or hex
///   characters with a letter, a digit and a piece of 16 or more without a separator.
///
/// The rest is kept as it is: error codes, UUIDs and event ids, SQL errors, paths.
///
/// An application's own redactor can run this one first:
///
/// ```
/// use actix_outbox::redact::default_redactor;
/// use actix_outbox::RuntimeConfig;
///
/// // Also hide the name of an internal host.
/// let config = RuntimeConfig::default()
///     .redact_errors(|message| default_redactor(message).replace("db-7.corp", "[host]"));
/// assert_eq!(
///     default_redactor("login failed for ann@example.com, password=hunter2"),
///     "login failed for [redacted], password=[redacted]",
/// );
/// # let _ = config;
/// ```
pub fn default_redactor(message: &str) -> String {
    let s = url_passwords(message);
    let s = authorization_values(&s);
    let s = sensitive_pairs(&s);
    let s = email_addresses(&s);
    opaque_tokens(&s)
}

/// An application's redaction of error text.
type RedactFn = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// The redaction in force: the application's, or [`default_redactor`] (`None`).
#[derive(Clone, Default)]
pub(crate) struct Redactor(Option<RedactFn>);

impl fmt::Debug for Redactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Redactor(custom)"
        } else {
            "Redactor(default)"
        })
    }
}

impl Redactor {
    pub(crate) fn custom(f: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        Redactor(Some(Arc::new(f)))
    }

    /// `message` redacted. An application's redactor that panics stores the marker alone:
    /// nothing of a message it could not redact, and no panic in the middle of a mark.
    pub(crate) fn apply(&self, message: &str) -> String {
        match &self.0 {
            None => default_redactor(message),
            Some(f) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(message)))
                .unwrap_or_else(|_| REDACTED.to_owned()),
        }
    }
}

/// Replaces the byte ranges `spans` (sorted by start) of `s` by [`REDACTED`]; a range that
/// starts inside the one before is left out.
fn replace_spans(s: &str, spans: &[(usize, usize)]) -> String {
    let mut out = String::with_capacity(s.len());
    let mut at = 0;
    for &(start, end) in spans {
        if start < at {
            continue;
        }
        out.push_str(&s[at..start]);
        out.push_str(REDACTED);
        at = end;
    }
    out.push_str(&s[at..]);
    out
}

/// The end of the run of bytes from `start` that `class` accepts.
fn run_end(b: &[u8], start: usize, class: impl Fn(u8) -> bool) -> usize {
    b[start..]
        .iter()
        .position(|&c| !class(c))
        .map_or(b.len(), |n| start + n)
}

/// The start of the run of bytes ending at `end` that `class` accepts.
fn run_start(b: &[u8], end: usize, class: impl Fn(u8) -> bool) -> usize {
    b[..end]
        .iter()
        .rposition(|&c| !class(c))
        .map_or(0, |n| n + 1)
}

/// `scheme://user:password@host`: the password. A user alone (`postgres://app@db`) stays.
fn url_passwords(s: &str) -> String {
    let b = s.as_bytes();
    let mut spans = Vec::new();
    let mut from = 0;
    while let Some(n) = s[from..].find("://") {
        let start = from + n + 3;
        let end = run_end(b, start, |c| {
            !c.is_ascii_whitespace()
                && !matches!(c, b'/' | b'?' | b'#' | b'"' | b'\'' | b'<' | b'>')
        });
        let authority = &s[start..end];
        if let Some(at) = authority.rfind('@') {
            if let Some(colon) = authority[..at].find(':') {
                if colon + 1 < at {
                    spans.push((start + colon + 1, start + at));
                }
            }
        }
        from = end.max(start);
    }
    replace_spans(s, &spans)
}

fn is_token_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~' | b'+' | b'/' | b'=')
}

/// `Bearer <token>` and `Basic <credentials>`, in any case: the credentials, unless they are a
/// word of the sentence ([`WORD_MAX`]).
fn authorization_values(s: &str) -> String {
    let b = s.as_bytes();
    let lower = s.to_ascii_lowercase();
    let mut spans = Vec::new();
    for scheme in ["bearer", "basic"] {
        let mut from = 0;
        while let Some(n) = lower[from..].find(scheme) {
            let at = from + n;
            from = at + scheme.len();
            let starts_word = at == 0 || !b[at - 1].is_ascii_alphanumeric();
            let value = run_end(b, from, |c| c == b' ' || c == b'\t');
            if !starts_word || value == from {
                continue;
            }
            let end = run_end(b, value, is_token_byte);
            if end > value && !is_word(&s[value..end]) {
                spans.push((value, end));
                from = end;
            }
        }
    }
    spans.sort_unstable();
    replace_spans(s, &spans)
}

/// Letters only, lower case but for the first, and short: a word, not a credential.
fn is_word(v: &str) -> bool {
    v.len() < WORD_MAX
        && v.bytes().all(|c| c.is_ascii_alphabetic())
        && v.bytes().skip(1).all(|c| c.is_ascii_lowercase())
}

fn is_key_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

/// `key=value`, `key: value`, `"key": "value"` whose key is sensitive: the value (inside its
/// quotes, when quoted). A value that opens an object or a list is left to the pairs inside.
fn sensitive_pairs(s: &str) -> String {
    let b = s.as_bytes();
    let mut rules: Option<PayloadRules> = None;
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let sep = b[i];
        i += 1;
        if sep != b'=' && sep != b':' {
            continue;
        }
        // `scheme://`, `==`, `:=`: not a pair.
        if (sep == b':' && b[i..].starts_with(b"//")) || b.get(i) == Some(&b'=') {
            continue;
        }
        let mut key_end = run_start(b, i - 1, |c| c == b' ' || c == b'\t');
        if key_end > 0 && matches!(b[key_end - 1], b'"' | b'\'') {
            key_end -= 1;
        }
        let key_start = run_start(b, key_end, is_key_byte);
        if key_start == key_end {
            continue;
        }
        let rules = rules.get_or_insert_with(PayloadRules::default);
        if !rules.is_sensitive(&s[key_start..key_end]) {
            continue;
        }
        let value = run_end(b, i, |c| c == b' ' || c == b'\t');
        if let Some(span) = value_span(b, value) {
            spans.push(span);
            i = span.1;
        }
    }
    replace_spans(s, &spans)
}

/// The value starting at `start`: inside its quotes when quoted (escapes skipped), else up to
/// the next space or delimiter. `None` when there is none, or it opens an object or a list.
fn value_span(b: &[u8], start: usize) -> Option<(usize, usize)> {
    match b.get(start)? {
        &q @ (b'"' | b'\'') => {
            let mut j = start + 1;
            while j < b.len() && b[j] != q {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = j.min(b.len());
            (end > start + 1).then_some((start + 1, end))
        }
        b'{' | b'[' => None,
        _ => {
            let end = run_end(b, start, |c| {
                !c.is_ascii_whitespace() && !matches!(c, b',' | b';' | b'&' | b')' | b'}' | b']')
            });
            (end > start).then_some((start, end))
        }
    }
}

fn is_local_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b".!#$%&'*+/=?^_`{|}~-".contains(&c)
}

fn is_domain_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-')
}

/// `local@domain.tld`: the whole address. Not the user of a URL (`postgres://app@db.local`).
fn email_addresses(s: &str) -> String {
    let b = s.as_bytes();
    let mut spans = Vec::new();
    for (at, _) in s.match_indices('@') {
        if spans.last().is_some_and(|&(_, end)| at < end) {
            continue;
        }
        let start = run_start(b, at, is_local_byte);
        // An address starts with a letter or a digit: not with the quote or the `//` before it.
        let start = start
            + b[start..at]
                .iter()
                .take_while(|c| !c.is_ascii_alphanumeric())
                .count();
        let end = run_end(b, at + 1, is_domain_byte);
        let domain = s[at + 1..end].trim_end_matches(['.', '-']);
        let end = at + 1 + domain.len();
        let tld = domain.rsplit('.').next().unwrap_or("");
        let dotted = domain.contains('.') && !domain.starts_with(['.', '-']);
        let in_url = b[..start].ends_with(b"//");
        if start < at
            && dotted
            && tld.len() >= 2
            && tld.bytes().all(|c| c.is_ascii_alphabetic())
            && !in_url
        {
            spans.push((start, end));
        }
    }
    replace_spans(s, &spans)
}

fn is_opaque_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'=' | b'_' | b'-')
}

/// JWTs (`eyJ` and two or more dots), and runs of base64 or hex characters that look random
/// ([`is_opaque`]).
fn opaque_tokens(s: &str) -> String {
    let b = s.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !is_opaque_byte(b[i]) {
            i += 1;
            continue;
        }
        let end = run_end(b, i, |c| is_opaque_byte(c) || c == b'.');
        let run = &s[i..end];
        if run.starts_with("eyJ") && run.matches('.').count() >= 2 {
            spans.push((i, end));
        } else {
            let mut at = i;
            for piece in run.split('.') {
                if is_opaque(piece) {
                    spans.push((at, at + piece.len()));
                }
                at += piece.len() + 1;
            }
        }
        i = end;
    }
    replace_spans(s, &spans)
}

/// [`TOKEN_MIN`] or more base64/hex characters with a letter, a digit, and a piece of
/// [`TOKEN_PIECE_MIN`] without a separator.
fn is_opaque(run: &str) -> bool {
    run.len() >= TOKEN_MIN
        && run.bytes().any(|c| c.is_ascii_digit())
        && run.bytes().any(|c| c.is_ascii_alphabetic())
        && run
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|piece| piece.len() >= TOKEN_PIECE_MIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> String {
        default_redactor(s)
    }

    #[test]
    fn url_passwords_are_redacted_and_the_rest_of_the_url_kept() {
        assert_eq!(
            r("could not connect to postgres://app:s3cr3t@db.internal:5432/orders"),
            "could not connect to postgres://app:[redacted]@db.internal:5432/orders"
        );
        assert_eq!(
            r("GET https://bot:p@ss:w0rd@api.example.com/v1?x=1 failed"),
            "GET https://bot:[redacted]@api.example.com/v1?x=1 failed"
        );
        assert_eq!(
            r("connect to postgres://app@db.internal/orders: refused"),
            "connect to postgres://app@db.internal/orders: refused"
        );
        assert_eq!(
            r("GET https://api.example.com/v1/orders: 503"),
            "GET https://api.example.com/v1/orders: 503"
        );
    }

    #[test]
    fn authorization_credentials_are_redacted_but_not_the_words_around_them() {
        assert_eq!(
            r("401 for Authorization: Bearer abc.def-123_x"),
            "401 for Authorization: Bearer [redacted]"
        );
        assert_eq!(
            r("sent bearer  AbCdEf123, refused"),
            "sent bearer  [redacted], refused"
        );
        assert_eq!(
            r("header Authorization: Basic dXNlcjpodW50ZXIy"),
            "header Authorization: Basic [redacted]"
        );
        for kept in [
            "invalid Bearer token",
            "missing bearer Token in the request",
            "Basic validation failed",
            "a basic error",
            "the bearer, not the holder",
        ] {
            assert_eq!(r(kept), kept);
        }
    }

    #[test]
    fn sensitive_pairs_lose_their_values() {
        for (message, redacted) in [
            (
                "login failed: password=hunter2 user=ann",
                "login failed: password=[redacted] user=ann",
            ),
            (
                "userPassword = hunter2; retry",
                "userPassword = [redacted]; retry",
            ),
            (
                "api_key: AKIA-1, region: eu",
                "api_key: [redacted], region: eu",
            ),
            (
                r#"body {"access_token": "x\"y", "expires_in": 3600}"#,
                r#"body {"access_token": "[redacted]", "expires_in": 3600}"#,
            ),
            (
                "?client_secret=abc&grant=code",
                "?client_secret=[redacted]&grant=code",
            ),
            ("'X-Api-Key': 'k-1'", "'X-Api-Key': '[redacted]'"),
            ("Token: expired", "Token: [redacted]"),
        ] {
            assert_eq!(r(message), redacted, "{message}");
        }
        for kept in [
            "tokens_used=42 order_id=7",
            "payment_authorization_id: 9",
            r#"{"credentials": {"user": "ann"}}"#,
            "password= ",
            "if token == x",
        ] {
            assert_eq!(r(kept), kept);
        }
    }

    #[test]
    fn email_addresses_are_redacted() {
        assert_eq!(
            r("no customer ann.lee+orders@mail.example.co.uk, sorry"),
            "no customer [redacted], sorry"
        );
        assert_eq!(
            r("Key (email)=(bob@example.com) already exists."),
            "Key (email)=([redacted]) already exists."
        );
        assert_eq!(r("'x@y.io'"), "'[redacted]'");
        for kept in ["@handle", "a@b", "user@localhost", "v1@2.0", "ssh git@host"] {
            assert_eq!(r(kept), kept);
        }
    }

    #[test]
    fn jwts_and_long_opaque_tokens_are_redacted() {
        let jwt =
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U";
        assert_eq!(r(&format!("rejected {jwt}!")), "rejected [redacted]!");
        for secret in [
            "0123456789abcdef0123456789abcdef",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            "sk_live_51HqLyjWDarjtT1zdp7dcXYZ",
            "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
        ] {
            assert_eq!(
                r(&format!("key {secret} refused")),
                "key [redacted] refused"
            );
        }
    }

    #[test]
    fn ordinary_error_text_is_kept() {
        for kept in [
            "PAYMENT_DECLINED",
            "ORDER_PAYMENT_AUTHORIZATION_FAILED: card declined by issuer",
            "event 0190f1d2-7a3b-7c4d-8e5f-0123456789ab: handler failed",
            "no order 550e8400-e29b-41d4-a716-446655440000 for consumer billing.v2",
            "duplicate key value violates unique constraint \"orders_pkey\"",
            "null value in column \"password_hash\" of relation \"users\" violates not-null constraint",
            "could not open file \"/var/lib/postgresql/16/main/base/16384/2619\": No such file",
            "the handler did not finish within 30s",
            "error: connection refused (os error 111), retry after 250ms",
            "tokens_used exceeded: 12000 > 10000",
            "HTTP 503 from https://api.example.com/v1/payments?order=42",
            "naïve café — ünïcode stays: déjà vu",
        ] {
            assert_eq!(r(kept), kept);
        }
    }

    #[test]
    fn a_custom_redactor_replaces_the_default_and_a_panicking_one_stores_the_marker() {
        let own = Redactor::custom(|m| m.replace("ACME", "[customer]"));
        assert_eq!(own.apply("ACME password=x"), "[customer] password=x");
        let broken = Redactor::custom(|_| panic!("bad redactor"));
        assert_eq!(broken.apply("password=x"), REDACTED);
        assert_eq!(
            Redactor::default().apply("password=x"),
            "password=[redacted]"
        );
    }
}
