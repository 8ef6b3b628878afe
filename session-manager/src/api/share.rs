//! `GET /v1/share` (`devctl share`): each accounting group's share, decayed cost-weighted
//! usage and fair-share factor, like Slurm's `sshare`. Admins see every user's usage; others
//! see the groups and their own line.

use axum::extract::State;
use axum::Json;
use ongrid_core::api::{FairShareView, GroupShareView, UserShareView};

use super::callers::CurrentUser;
use super::{ApiError, AppState};

pub async fn share(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<FairShareView>, ApiError> {
    let Some(config) = &state.config.fair_share else {
        return Ok(Json(FairShareView {
            enabled: false,
            half_life_secs: 0,
            groups: Vec::new(),
        }));
    };
    let accounts = state.store.usage_accounts().await?;
    let standings = crate::scheduling::fair_share::current(&accounts, config, state.clock.now());
    let groups = standings
        .into_iter()
        .map(|standing| GroupShareView {
            group: standing.group.to_string(),
            share: standing.share,
            share_fraction: standing.share_fraction,
            usage: standing.usage,
            usage_fraction: standing.usage_fraction,
            factor: standing.factor,
            users: standing
                .users
                .into_iter()
                .filter(|(dn, _)| caller.admin || *dn == caller.user.dn)
                .map(|(dn, usage)| UserShareView { dn, usage })
                .collect(),
        })
        .collect();
    Ok(Json(FairShareView {
        enabled: true,
        half_life_secs: config.half_life.as_secs(),
        groups,
    }))
}
