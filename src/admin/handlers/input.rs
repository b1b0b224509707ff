//! An action's input: its body, read within a bound and parsed as JSON, and its reason.

use actix_web::http::StatusCode;
use actix_web::{web, FromRequest};
use serde::de::DeserializeOwned;

use crate::admin::error::*;

use super::*;

/// An action's body, read up to [`MAX_BODY`] bytes. Past that, a JSON 413 `BODY_TOO_LARGE`
/// (actix's own limit would answer in plain text, without a code).
pub(super) struct Body(pub(super) web::Bytes);

impl FromRequest for Body {
    type Error = AdminError;
    type Future = futures_util::future::LocalBoxFuture<'static, Result<Self, AdminError>>;

    fn from_request(
        _: &actix_web::HttpRequest,
        payload: &mut actix_web::dev::Payload,
    ) -> Self::Future {
        use futures_util::StreamExt;
        let mut payload = payload.take();
        Box::pin(async move {
            let mut buf = web::BytesMut::new();
            while let Some(chunk) = payload.next().await {
                let chunk = chunk.map_err(|e| {
                    AdminError::bad_request(
                        INVALID_BODY,
                        format!("the body could not be read: {e}"),
                    )
                })?;
                if buf.len() + chunk.len() > MAX_BODY {
                    return Err(AdminError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        BODY_TOO_LARGE,
                        format!("a body is at most {MAX_BODY} bytes"),
                    ));
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(Body(buf.freeze()))
        })
    }
}

/// Parses an optional JSON body: an empty body is the default (no reason, no ids).
pub(super) fn parse_body<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, AdminError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        AdminError::bad_request(
            INVALID_BODY,
            format!("the body is not valid for this action: {e}"),
        )
    })
}

pub(super) fn reason(v: Option<String>, required: bool) -> Result<Option<String>, AdminError> {
    match given(v) {
        None if required => Err(AdminError::bad_request(
            REASON_REQUIRED,
            "this action needs a non-empty \"reason\", kept in the audit trail",
        )),
        Some(r) if r.chars().count() > MAX_REASON_CHARS => Err(AdminError::bad_request(
            REASON_TOO_LONG,
            format!("a reason is at most {MAX_REASON_CHARS} characters"),
        )),
        Some(r) if r.contains('\0') => Err(AdminError::bad_request(
            INVALID_BODY,
            "a reason must not hold a NUL character",
        )),
        r => Ok(r),
    }
}
