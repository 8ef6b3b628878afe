//! `POST /v1/dashboard/links` (`devctl dashboard`): a single-use login link for the web
//! dashboard, made by [`crate::app::logins`].

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::DashboardLink;

use super::callers::CurrentUser;
use super::{ApiError, AppState};

pub async fn create_link(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<(StatusCode, Json<DashboardLink>), ApiError> {
    let link = crate::app::logins::create_link(&state, &caller).await?;
    Ok((StatusCode::CREATED, Json(link)))
}
