//! `devctl dashboard`: a login link to the manager's web dashboard (`POST /v1/dashboard/links`),
//! made with the caller's grid credential. The link logs one browser in, once, within a few
//! minutes; the browser then stays logged in for a working day or until the credential expires.

use chrono::{DateTime, Utc};
use ongrid_core::api::DashboardLink;

use crate::client::Client;
use crate::format::{format_time, time_left};
use crate::terminal::{JsonArgs, Terminal};

pub async fn run(args: JsonArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let link: DashboardLink = client.post("v1/dashboard/links").send().await?;
    let url = format!("{}{}", client.context().manager_url, link.path);
    if args.json {
        return term.json(&serde_json::json!({ "url": url, "expires_at": link.expires_at }));
    }
    term.print(&render(&url, link.expires_at, Utc::now()))
}

/// The text of `devctl dashboard` as of `now`.
pub fn render(url: &str, expires_at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    format!(
        "Open this link in your browser (it works once, for {}, until {}):\n\n  {url}\n",
        time_left(expires_at, now),
        format_time(expires_at)
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
        assert!(text.contains("works once"), "{text}");
    }
}
