//! Who is calling: bearer tokens compared in constant time, or the application's own guard.
//!
//! Authentication is an extractor ([`Operator`]) that every data endpoint takes as its *first*
//! argument. actix-web polls extractors in order, so a request without valid credentials is
//! answered 401 before its body is read or the database is touched.

use std::future::{ready, Ready};
use std::sync::Arc;

use actix_web::dev::Payload;
use actix_web::http::header;
use actix_web::{web, FromRequest, HttpRequest};

use super::error::{AdminError, CROSS_SITE, INVALID_QUERY};
use super::State;

/// The application's guard: the operator's name for an authorised request, `None` otherwise.
pub(crate) type Guard = Arc<dyn Fn(&HttpRequest) -> Option<String> + Send + Sync>;

/// How requests are authenticated.
#[derive(Clone)]
pub(crate) enum Auth {
    /// `Authorization: Bearer <token>`; each token names an operator.
    Tokens(Vec<NamedToken>),
    /// The application decides.
    Guard(Guard),
}

#[derive(Clone)]
pub(crate) struct NamedToken {
    pub operator: String,
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for NamedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("NamedToken")
            .field("operator", &self.operator)
            .finish_non_exhaustive()
    }
}

/// The authenticated operator; its name is written to the audit trail.
#[derive(Debug, Clone)]
pub(crate) struct Operator(pub String);

impl FromRequest for Operator {
    type Error = AdminError;
    type Future = Ready<Result<Self, AdminError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let st = req.app_data::<web::Data<State>>();
        let who = st.and_then(|st| authenticate(&st.auth, req));
        let guarded = st.is_some_and(|st| matches!(st.auth, Auth::Guard(_)));
        ready(match who {
            Some(name) => admissible(req, guarded).map(|()| Operator(name)),
            None => {
                tracing::warn!(
                    name: "admin.unauthorized",
                    method = %req.method(),
                    path = %req.path(),
                    peer = ?req.peer_addr(),
                    "admin.unauthorized: request without valid operator credentials refused"
                );
                Err(AdminError::unauthorized())
            }
        })
    }
}

/// Refuses, for an authenticated operator, what no operator's own client sends:
/// - with the application's guard (`guarded`), an action (POST) a browser sends for another
///   site's page. A guard that reads a session cookie would find the operator's credentials
///   on it: a form on any page the operator visits could retry or ignore rows. Browsers say
///   where a request comes from in `Sec-Fetch-Site` (to HTTPS and localhost), or else in
///   `Origin`, compared with the host the request was sent to (`Host`, or the proxy's
///   `Forwarded`/`X-Forwarded-Host`: a proxy that rewrites `Host` must set one of those). A
///   client that sends neither (curl, a script) is not a browser and is let through. Bearer
///   tokens are never sent by a browser on its own, so with tokens nothing is checked.
/// - a NUL (`%00`) in the path or query, which PostgreSQL's `text` refuses: it would surface as
///   a database failure instead of as bad input.
fn admissible(req: &HttpRequest, guarded: bool) -> Result<(), AdminError> {
    if req.path().contains("%00") || req.query_string().contains("%00") {
        return Err(AdminError::bad_request(
            INVALID_QUERY,
            "the path or query holds a NUL character (%00)",
        ));
    }
    if !guarded || req.method() != actix_web::http::Method::POST {
        return Ok(());
    }
    let header = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
    let same_origin = match (header("sec-fetch-site"), header(header::ORIGIN.as_str())) {
        (Some(site), _) => site == "same-origin" || site == "none",
        // The host only: behind a proxy that ends TLS, the scheme seen here may differ.
        (None, Some(origin)) => {
            origin.split_once("://").map(|(_, host)| host) == Some(req.connection_info().host())
        }
        (None, None) => true,
    };
    if same_origin {
        return Ok(());
    }
    tracing::warn!(
        name: "admin.cross_site",
        path = %req.path(),
        origin = header(header::ORIGIN.as_str()),
        "admin.cross_site: an action sent from another site's page refused"
    );
    Err(AdminError::new(
        actix_web::http::StatusCode::FORBIDDEN,
        CROSS_SITE,
        "actions are accepted only from the operator page's own origin",
    ))
}

/// The operator's name, or `None` for a request that must be refused.
pub(crate) fn authenticate(auth: &Auth, req: &HttpRequest) -> Option<String> {
    let name = match auth {
        Auth::Guard(guard) => guard(req)?,
        Auth::Tokens(tokens) => {
            let presented = bearer(req)?;
            // Compare against every token, without stopping at a match, so the time taken
            // does not tell which (or whether an early) token matched.
            let mut found: Option<&str> = None;
            for t in tokens {
                if ct_eq(presented, &t.secret) && found.is_none() {
                    found = Some(&t.operator);
                }
            }
            found?.to_owned()
        }
    };
    let name = name.trim();
    (!name.is_empty()).then(|| name.chars().take(200).collect())
}

/// The token of an `Authorization: Bearer <token>` header (scheme case-insensitive).
fn bearer(req: &HttpRequest) -> Option<&[u8]> {
    let value = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Equality whose running time depends only on the lengths, never on where the first
/// difference is. (The length of a configured token is not treated as a secret.)
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box keeps the optimiser from turning the fold back into an early exit.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    fn tokens() -> Auth {
        Auth::Tokens(vec![
            NamedToken {
                operator: "alice".into(),
                secret: b"alice-token-0123456789".to_vec(),
            },
            NamedToken {
                operator: "bob".into(),
                secret: b"bob-token-0123456789ab".to_vec(),
            },
        ])
    }

    #[test]
    fn constant_time_equality_is_equality() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"abcd"));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn a_bearer_token_names_its_operator() {
        let req = TestRequest::default()
            .insert_header(("Authorization", "Bearer bob-token-0123456789ab"))
            .to_http_request();
        assert_eq!(authenticate(&tokens(), &req).as_deref(), Some("bob"));
        let req = TestRequest::default()
            .insert_header(("authorization", "bearer alice-token-0123456789"))
            .to_http_request();
        assert_eq!(authenticate(&tokens(), &req).as_deref(), Some("alice"));
    }

    #[test]
    fn anything_else_is_refused() {
        for value in [
            "Bearer wrong",
            "Bearer ",
            "Basic YWxpY2U6dG9rZW4=",
            "alice-token-0123456789",
            "Bearer alice-token-012345678",
        ] {
            let req = TestRequest::default()
                .insert_header(("Authorization", value))
                .to_http_request();
            assert_eq!(authenticate(&tokens(), &req), None, "{value}");
        }
        let req = TestRequest::default().to_http_request();
        assert_eq!(authenticate(&tokens(), &req), None);
        assert_eq!(authenticate(&Auth::Tokens(vec![]), &req), None);
    }

    #[test]
    fn a_guard_decides_and_must_name_someone() {
        let guard: Guard = Arc::new(|req: &HttpRequest| {
            req.headers()
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
        let auth = Auth::Guard(guard);
        let req = TestRequest::default()
            .insert_header(("x-user", "carol"))
            .to_http_request();
        assert_eq!(authenticate(&auth, &req).as_deref(), Some("carol"));
        let req = TestRequest::default()
            .insert_header(("x-user", "  "))
            .to_http_request();
        assert_eq!(authenticate(&auth, &req), None);
    }
}
