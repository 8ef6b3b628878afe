//! The API's extractors, which turn rejections into [`ApiError`]s, and the middleware that logs
//! every refusal once.
//!
//! Every non-2xx response is an [`ongrid_core::api::ErrorBody`] ([`crate::app::error`]). A 401
//! or 403 is logged once by [`log_refusals`] with the caller and the reason, unless its handler
//! logged it already ([`ApiError::already_logged`]).

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::Json;
use serde::de::DeserializeOwned;

pub use crate::app::error::log_refusals;
pub use crate::app::error::ApiError;
use crate::domain::idempotency::{self, IdempotencyKey};

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

/// The request's `Idempotency-Key` header, if any ([`crate::domain::idempotency`]); a malformed
/// one is a `bad_request`.
#[derive(Debug, Clone, Default)]
pub struct RequestKey(pub Option<IdempotencyKey>);

impl<S> FromRequestParts<S> for RequestKey
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let Some(value) = parts.headers.get(idempotency::HEADER) else {
            return Ok(Self(None));
        };
        let text = value.to_str().map_err(|_| {
            ApiError::bad_request(format!("the {} header must be ASCII", idempotency::HEADER))
        })?;
        IdempotencyKey::parse(text)
            .map(|key| Self(Some(key)))
            .map_err(ApiError::bad_request)
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
