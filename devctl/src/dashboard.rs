//! `devctl dashboard`: a login link to the manager's web dashboard (`POST /v1/dashboard/links`),
//! made with the caller's grid credential. The link logs one browser in, once, within a few
//! minutes; the browser then stays logged in for a working day or until the credential expires.
//! [`login_link`] and [`works_once`] also serve `devctl session web`, whose links lead on to a
//! session's web app.

use chrono::{DateTime, Utc};
use ongrid_core::api::{DashboardLink, DashboardLinkRequest};

use crate::client::{Client, ClientError};
use crate::format::{format_time, time_left};
use crate::terminal::{JsonArgs, Terminal};

pub async fn run(args: JsonArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let link = login_link(client, None).await?;
    if args.json {
        return term.json(&serde_json::json!({ "url": link.url, "expires_at": link.expires_at }));
    }
    term.print(&render(&link.url, link.expires_at, Utc::now()))
}

/// A login link to open in a browser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginLink {
    /// The manager's URL and the link's path: `https://manager:8443/dashboard/login?token=...`.
    pub url: String,
    pub expires_at: DateTime<Utc>,
}

/// `POST /v1/dashboard/links`: a link that logs a browser in and then goes to `next`, a page of
/// the dashboard like `/dashboard/sessions/train1/apps/jupyter/`. Without `next` the request
/// has no body and the link goes to the dashboard's front page.
pub async fn login_link(client: &Client, next: Option<&str>) -> Result<LoginLink, ClientError> {
    let request = client.post("v1/dashboard/links");
    let request = match next {
        Some(next) => request.json(&DashboardLinkRequest {
            next: Some(next.to_owned()),
        }),
        None => request,
    };
    let link: DashboardLink = request.send().await?;
    Ok(LoginLink {
        url: format!("{}{}", client.context().manager_url, link.path),
        expires_at: link.expires_at,
    })
}

/// How long a link may be used, as of `now`: `it works once, for 4m 59s, until 2026-11-21
/// 10:05:00Z`.
pub fn works_once(expires_at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    format!(
        "it works once, for {}, until {}",
        time_left(expires_at, now),
        format_time(expires_at)
    )
}

/// The text of `devctl dashboard` as of `now`.
pub fn render(url: &str, expires_at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    format!(
        "Open this link in your browser ({}):\n\n  {url}\n",
        works_once(expires_at, now)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_is_on_its_own_line_with_its_expiry() {
        let now = DateTime::from_timestamp(1_795_255_200, 0).unwrap();
        let text = render(
            "https://manager:8443/dashboard/login?token=abc",
            now + chrono::TimeDelta::minutes(5),
            now,
        );
        assert!(
            text.contains("\n  https://manager:8443/dashboard/login?token=abc\n"),
            "{text}"
        );
        assert!(
            text.starts_with("Open this link in your browser (it works once, for 5m 0s, until "),
            "{text}"
        );
    }
}
