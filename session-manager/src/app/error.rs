//! The application's one error type, [`ApiError`]: a status, a code and a message that says
//! what to do, answered by the API as an [`ongrid_core::api::ErrorBody`] and by the dashboard as
//! a page. Every use case of [`crate::app`] fails with it (or with its own error enum, whose
//! variants the transports word themselves).
//!
//! A 5xx says only "internal error"; its cause is logged once, where the [`ApiError`] is made. A
//! 401 or 403 is logged once by the API's `log_refusals` with the caller and the reason, unless
//! its handler logged it already ([`ApiError::already_logged`]): the answer carries a
//! [`Refused`] for it.

use std::fmt;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ongrid_core::api::{ErrorBody, ErrorDetail};

use crate::domain::Refusal;
use crate::store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// The handler logged this refusal itself, at the level it deserves.
    logged: bool,
}

/// A 401 or 403 answer's message, handed from [`ApiError`]'s response to the API's
/// `log_refusals`.
#[derive(Debug, Clone)]
pub struct Refused(pub String);

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            logged: false,
        }
    }

    /// Marks a refusal its handler has logged, so `log_refusals` does not log it again.
    pub fn already_logged(mut self) -> Self {
        self.logged = true;
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    pub fn unsatisfiable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unsatisfiable", message)
    }

    /// A service the request needs (a grid target's engine) cannot be reached; `message` says
    /// what to do and nothing of the cause, which the caller logged.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    /// Logs `cause` (the only place it is logged) and answers "internal error".
    pub fn internal(cause: impl fmt::Display) -> Self {
        tracing::error!(error = %cause, "Request failed.");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error",
        )
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Invalid(message) => Self::bad_request(message),
            Refusal::Conflict(message) => Self::conflict(message),
            Refusal::Forbidden(message) => Self::forbidden(message),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::InvalidTransition(e) => Self::conflict(e.to_string()),
            StoreError::UserRemoved(dn) => Self::forbidden(format!(
                "an admin removed {dn} while this request ran: ask a site admin to run \
                 `devctl admin user restore '{dn}'`"
            )),
            other => Self::internal(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let refused = (matches!(
            self.status,
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) && !self.logged)
            .then(|| Refused(self.message.clone()));
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(refused) = refused {
            response.extensions_mut().insert(refused);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn errors_are_error_bodies() {
        let response = ApiError::not_found("no session named x").into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.error.code, "not_found");
        assert_eq!(body.error.message, "no session named x");
    }

    #[tokio::test]
    async fn internal_errors_hide_their_cause() {
        let response = ApiError::internal("disk on fire").into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.error.code, "internal");
        assert_eq!(body.error.message, "internal error");
    }
}
