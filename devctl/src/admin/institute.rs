//! `devctl admin institute add|rm|ls|show` (`POST|GET /v1/institutes`,
//! `GET|DELETE /v1/institutes/{name}`): the institutes whose networks may connect to the SSH
//! gateway.

use clap::{Args, Subcommand};
use ongrid_core::api::Institute;
use ongrid_core::{Cidr, InstituteName};

use crate::client::Client;
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Subcommand)]
pub enum InstituteCommand {
    /// Allow an institute's networks: the gateway accepts connections from them
    Add(InstituteAddArgs),
    /// Remove an institute: its networks are no longer allowed
    #[command(alias = "remove")]
    Rm(InstituteNameArgs),
    /// List the allowed institutes and their networks
    #[command(alias = "list")]
    Ls(JsonArgs),
    /// Show one institute's networks
    Show(InstituteNameArgs),
}

#[derive(Debug, Clone, Args)]
pub struct InstituteAddArgs {
    /// The institute's name: lower-case letters, digits, '-', '_' and '.', like uni-glasgow
    pub name: InstituteName,
    /// Its networks, like 192.0.2.0/24 or 2001:db8::/32 (a bare address is one host)
    #[arg(required = true, value_name = "CIDR")]
    pub cidrs: Vec<Cidr>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct InstituteNameArgs {
    /// The institute's name
    pub name: InstituteName,
    #[command(flatten)]
    pub output: JsonArgs,
}

pub async fn run(
    command: InstituteCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        InstituteCommand::Add(InstituteAddArgs {
            name,
            cidrs,
            output,
        }) => {
            let institute: Institute = client
                .post("v1/institutes")
                .json(&Institute { name, cidrs })
                .send()
                .await?;
            term.show(output.json, &institute, render_institute_added)
        }
        InstituteCommand::Rm(InstituteNameArgs { name, output }) => {
            let institute: Institute = client
                .delete(&format!("v1/institutes/{name}"))
                .send()
                .await?;
            term.show(output.json, &institute, render_institute_removed)
        }
        InstituteCommand::Ls(output) => {
            let institutes: Vec<Institute> = client.get("v1/institutes").send().await?;
            let width = term.width;
            term.show(output.json, &institutes, |institutes| {
                render_institutes(institutes, width)
            })
        }
        InstituteCommand::Show(InstituteNameArgs { name, output }) => {
            let institute: Institute = client.get(&format!("v1/institutes/{name}")).send().await?;
            term.show(output.json, &institute, render_institute)
        }
    }
}

fn networks(institute: &Institute) -> String {
    institute
        .cidrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn render_institute_added(institute: &Institute) -> String {
    format!(
        "institute {} added: {}\n",
        institute.name,
        networks(institute)
    )
}

pub fn render_institute_removed(institute: &Institute) -> String {
    format!(
        "institute {} removed: {} no longer allowed\n",
        institute.name,
        networks(institute)
    )
}

/// `devctl admin institute show`: the name, then one network per line.
pub fn render_institute(institute: &Institute) -> String {
    let mut table = Table::bare();
    table.field("name", institute.name.to_string());
    if institute.cidrs.is_empty() {
        table.field("networks", "-");
    }
    for (i, cidr) in institute.cidrs.iter().enumerate() {
        let label = if i == 0 { "networks:" } else { "" };
        table.row([label.to_owned(), cidr.to_string()]);
    }
    table.to_string()
}

/// `devctl admin institute ls`.
pub fn render_institutes(institutes: &[Institute], width: Option<u16>) -> String {
    if institutes.is_empty() {
        return "no institutes: the SSH gateway accepts no connection until one is added with \
                devctl admin institute add NAME CIDR...\n"
            .to_owned();
    }
    let mut table = Table::new(&["NAME", "NETWORKS"]);
    for institute in institutes {
        table.row([institute.name.to_string(), networks(institute)]);
    }
    table.keep_whole(&[0]);
    table.render(width, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn institute(name: &str, cidrs: &[&str]) -> Institute {
        Institute {
            name: InstituteName::parse(name).unwrap(),
            cidrs: cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect(),
        }
    }

    #[test]
    fn institutes_list_their_networks() {
        let local = institute("local", &["127.0.0.0/8", "::1/128"]);
        assert_eq!(
            render_institute(&local),
            "name:      local\nnetworks:  127.0.0.0/8\n           ::1/128\n"
        );
        assert_eq!(
            render_institutes(
                &[local.clone(), institute("cern.ch", &["192.0.2.0/24"])],
                None
            ),
            "NAME     NETWORKS\nlocal    127.0.0.0/8, ::1/128\ncern.ch  192.0.2.0/24\n"
        );
        assert_eq!(
            render_institute_added(&local),
            "institute local added: 127.0.0.0/8, ::1/128\n"
        );
        assert_eq!(
            render_institute_removed(&local),
            "institute local removed: 127.0.0.0/8, ::1/128 no longer allowed\n"
        );
        assert!(render_institutes(&[], None).starts_with("no institutes: "));
    }
}
