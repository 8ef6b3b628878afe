//! `POST /v1/dashboard/links` (`devctl dashboard`, `devctl session web`): a single-use login
//! link for the web dashboard, made by [`crate::app::logins`]. The body is optional: none, an
//! empty one and `{}` ask for a link to the front page; `{"next": PATH}` for one that lands on
//! that page of the dashboard ([`NextPath`]).

use axum::body::Body;
use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::{DashboardLink, DashboardLinkRequest};

use super::callers::CurrentUser;
use super::{ApiError, ApiJson, AppState};
use crate::app::logins::NextPath;

/// The largest body read (a next path is at most 1 KiB).
const BODY_LIMIT: usize = 16 * 1024;

pub async fn create_link(
    State(state): State<AppState>,
    caller: CurrentUser,
    request: Request,
) -> Result<(StatusCode, Json<DashboardLink>), ApiError> {
    let body = optional_body(request).await?;
    let next = body
        .next
        .as_deref()
        .map(NextPath::parse)
        .transpose()
        .map_err(|err| ApiError::bad_request(err.to_string()))?;
    let link = crate::app::logins::create_link(&state, &caller, next.as_ref()).await?;
    Ok((StatusCode::CREATED, Json(link)))
}

/// The request's body: the default for none (or only white space), else JSON read as every
/// body of the API is ([`ApiJson`]).
async fn optional_body(request: Request) -> Result<DashboardLinkRequest, ApiError> {
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, BODY_LIMIT)
        .await
        .map_err(|err| {
            ApiError::bad_request(format!("cannot read the body (16 KiB at most): {err}"))
        })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(DashboardLinkRequest::default());
    }
    let request = Request::from_parts(parts, Body::from(bytes));
    let ApiJson(body) = ApiJson::from_request(request, &()).await?;
    Ok(body)
}
