//! The API's one error type and the extractors that turn rejections into it.
//!
//! Every non-2xx response is an [`ongrid_core::api::ErrorBody`]. A 5xx says only
//! "internal error"; its cause is logged once, where the [`ApiError`] is made. A 401 or 403 is
//! logged once by [`log_refusals`] with the caller and the reason, unless its handler logged
//! it already ([`ApiError::already_logged`]).

use std::fmt;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ongrid_core::api::{ErrorBody, ErrorDetail};
use serde::de::DeserializeOwned;

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

/// A 401 or 403 answer's message, handed from [`ApiError`]'s response to [`log_refusals`].
#[derive(Debug, Clone)]
struct Refused(String);

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            logged: false,
        }
    }

    /// Marks a refusal its handler has logged, so [`log_refusals`] does not log it again.
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

/// Middleware: logs every 401 and 403 once, with the reason and who asked (the peer's address
/// and, with a certificate, its DN; a token is never logged). The reason and the path are
/// logged with `Debug` formatting, so a caller's strings in them cannot forge log lines.
pub async fn log_refusals(request: Request, next: axum::middleware::Next) -> Response {
    let peer = request.extensions().get::<crate::auth::Peer>().map(|peer| {
        (
            peer.addr,
            peer.identity.as_ref().map(|identity| identity.dn.clone()),
        )
    });
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    if let Some(Refused(reason)) = response.extensions().get::<Refused>() {
        let status = response.status().as_u16();
        let (address, dn) = match &peer {
            Some((address, dn)) => (Some(*address), dn.as_ref()),
            None => (None, None),
        };
        tracing::warn!(status, %method, ?path, peer = ?address, caller = ?dn.map(ToString::to_string), ?reason, "Request refused.");
    }
    response
}

/// `Json<T>` whose rejections (bad JSON, a value a newtype refuses) are `bad_request` bodies
/// carrying serde's message.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::bad_request(
            "the request body must be JSON with `Content-Type: application/json`",
        ),
        other => ApiError::bad_request(other.body_text()),
    }
}

/// The JSON body of an admin route, read but not parsed until the caller is known to be an
/// admin: [`AdminJson::parse`] takes the proof ([`super::callers::Admin`]). A non-admin is
/// refused with the 403 (logged by [`log_refusals`]) whatever their body holds, never with a
/// 400 that would show they may not even send it. Parsing rejects as [`ApiJson`] does.
pub struct AdminJson<T> {
    request: Request,
    body: std::marker::PhantomData<fn() -> T>,
}

impl<S, T> FromRequest<S> for AdminJson<T>
where
    S: Send + Sync,
{
    type Rejection = std::convert::Infallible;

    async fn from_request(request: Request, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Self {
            request,
            body: std::marker::PhantomData,
        })
    }
}

impl<T: DeserializeOwned> AdminJson<T> {
    /// The body, once `admin` shows the caller may send it.
    pub async fn parse(self, admin: super::callers::Admin) -> Result<T, ApiError> {
        let _ = admin;
        ApiJson::<T>::from_request(self.request, &())
            .await
            .map(|ApiJson(body)| body)
    }
}

/// The query of an admin route, parsed only once the caller is known to be an admin, as
/// [`AdminJson`] is; rejections as [`ApiQuery`]'s.
pub struct AdminQuery<T> {
    uri: axum::http::Uri,
    query: std::marker::PhantomData<fn() -> T>,
}

impl<S, T> FromRequestParts<S> for AdminQuery<T>
where
    S: Send + Sync,
{
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Self {
            uri: parts.uri.clone(),
            query: std::marker::PhantomData,
        })
    }
}

impl<T: DeserializeOwned> AdminQuery<T> {
    /// The query, once `admin` shows the caller may send it.
    pub fn parse(self, admin: super::callers::Admin) -> Result<T, ApiError> {
        let _ = admin;
        Query::<T>::try_from_uri(&self.uri)
            .map(|Query(query)| query)
            .map_err(|rejection| ApiError::bad_request(rejection.body_text()))
    }
}

/// `Query<T>` with `bad_request` rejections.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(value)| Self(value))
            .map_err(|rejection: QueryRejection| ApiError::bad_request(rejection.body_text()))
    }
}

/// `Path<T>` with `bad_request` rejections.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(value)| Self(value))
            .map_err(|rejection: PathRejection| ApiError::bad_request(rejection.body_text()))
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
