//! `devctl job targets` (`GET /v1/targets`): where the caller's jobs may run, which target
//! takes jobs that name none, and the local account they run under on each grid target.

use clap::Args;
use ongrid_core::job::TargetInfo;

use crate::client::Client;
use crate::table::Table;
use crate::terminal::Terminal;

#[derive(Debug, Clone, Args)]
pub struct JobTargetsArgs {
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

/// `devctl job targets`
pub async fn run(
    args: JobTargetsArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let targets: Vec<TargetInfo> = client.get("v1/targets").send().await?;
    let width = term.width;
    term.show(args.json, &targets, |targets| {
        render_targets(targets, width)
    })
}

/// The table of `devctl job targets`, then why any target refuses the caller.
pub fn render_targets(targets: &[TargetInfo], width: Option<u16>) -> String {
    let mut table = Table::new(&["TARGET", "DEFAULT", "ACCOUNT", "WHERE"]);
    table.keep_whole(&[0, 1, 2]);
    for target in targets {
        table.row([
            target.target.to_string(),
            if target.default { "yes" } else { "" }.to_owned(),
            match (&target.account, &target.refusal) {
                (Some(account), _) => account.clone(),
                (None, Some(_)) => "none".to_owned(),
                (None, None) => "-".to_owned(),
            },
            target.description.clone(),
        ]);
    }
    let mut text = table.render(width, "");
    for target in targets {
        if let Some(refusal) = &target.refusal {
            text.push_str(&format!("{}: {refusal}\n", target.target));
        }
    }
    text.push_str("submit to one with devctl job submit --to TARGET ...\n");
    text
}
