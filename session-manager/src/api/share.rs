//! `GET /v1/share` (`devctl share`): each accounting group's share, decayed cost-weighted
//! usage and fair-share factor, like Slurm's `sshare`. Admins see every user's usage; others
//! see the groups and their own line.

use axum::extract::State;
use axum::Json;
use ongrid_core::api::FairShareView;

use super::callers::CurrentUser;
use super::{ApiError, AppState};

pub async fn share(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<FairShareView>, ApiError> {
    Ok(Json(
        crate::app::views::fair_share_view(&state, &caller).await?,
    ))
}
