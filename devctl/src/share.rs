//! `devctl share`: the site's fair share (`GET /v1/share`), like Slurm's `sshare`: each
//! accounting group's share, decayed cost-weighted GPU-hours and fair-share factor (higher goes
//! first), and under each group its users' usage (every user for admins, yourself otherwise).

use ongrid_core::api::FairShareView;

use crate::client::Client;
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

pub async fn run(args: JsonArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let view: FairShareView = client.get("v1/share").send().await?;
    term.show(args.json, &view, render)
}

/// The text of `devctl share`.
pub fn render(view: &FairShareView) -> String {
    if !view.enabled {
        return "this site has no fair share: waiting requests are served first come, first \
                served\n"
            .to_owned();
    }
    let mut table = Table::new(&["GROUP", "USER", "SHARE", "GPU-HOURS", "USAGE", "FACTOR"]);
    for group in &view.groups {
        table.row([
            group.group.clone(),
            String::new(),
            format!("{} ({:.0}%)", group.share, group.share_fraction * 100.0),
            format!("{:.3}", group.usage),
            format!("{:.0}%", group.usage_fraction * 100.0),
            format!("{:.3}", group.factor),
        ]);
        for user in &group.users {
            table.row([
                String::new(),
                user.dn.to_string(),
                String::new(),
                format!("{:.3}", user.usage),
                String::new(),
                String::new(),
            ]);
        }
    }
    let days = view.half_life_secs as f64 / 86_400.0;
    format!(
        "{table}GPU-hours are cost-weighted and halve every {}; a factor of 1 is unused, 0.5 at \
         its share; higher goes first\n",
        if (days - days.round()).abs() < 1e-9 && days >= 1.0 {
            format!("{days:.0} day{}", if days == 1.0 { "" } else { "s" })
        } else {
            format!("{:.1} hours", view.half_life_secs as f64 / 3600.0)
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::api::{GroupShareView, UserShareView};
    use ongrid_core::Dn;

    #[test]
    fn share_lists_groups_with_their_users() {
        let view = FairShareView {
            enabled: true,
            half_life_secs: 86_400,
            groups: vec![
                GroupShareView {
                    group: "cms".into(),
                    share: 1,
                    share_fraction: 0.25,
                    usage: 0.0,
                    usage_fraction: 0.0,
                    factor: 1.0,
                    users: Vec::new(),
                },
                GroupShareView {
                    group: "atlas".into(),
                    share: 3,
                    share_fraction: 0.75,
                    usage: 12.5,
                    usage_fraction: 1.0,
                    factor: 0.397,
                    users: vec![UserShareView {
                        dn: Dn::parse("/DC=org/CN=Alice").unwrap(),
                        usage: 12.5,
                    }],
                },
            ],
        };
        let text = render(&view);
        assert_eq!(
            text,
            "GROUP  USER              SHARE    GPU-HOURS  USAGE  FACTOR\n\
             cms                      1 (25%)  0.000      0%     1.000\n\
             atlas                    3 (75%)  12.500     100%   0.397\n       \
             /DC=org/CN=Alice           12.500\n\
             GPU-hours are cost-weighted and halve every 1 day; a factor of 1 is unused, 0.5 \
             at its share; higher goes first\n"
        );
        let off = FairShareView {
            enabled: false,
            half_life_secs: 0,
            groups: Vec::new(),
        };
        assert!(render(&off).starts_with("this site has no fair share"));
    }
}
