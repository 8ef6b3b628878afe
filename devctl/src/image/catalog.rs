//! `devctl image ls|show|rm` (`GET /v1/images[?all=true]`,
//! `GET|DELETE /v1/images/{name:version | sha256:hex}[?owner=DN]`), and how an image is
//! described.

use clap::Args;
use ongrid_core::image::{ImageLookup, ImageView};
use ongrid_core::Dn;

use super::progress::progress_line;
use crate::client::{Client, ClientError};
use crate::format::{format_bytes, format_time};
use crate::table::Table;
use crate::terminal::Terminal;

#[derive(Debug, Clone, Args)]
pub struct ImageLsArgs {
    /// Everybody's images (admins only)
    #[arg(long)]
    pub all: bool,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ImageRefArgs {
    /// NAME:VERSION, or sha256:DIGEST (also reaches an image whose tag --force moved on)
    #[arg(value_parser = parse_lookup, value_name = "IMAGE")]
    pub image: String,
    /// Another user's image (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

/// `devctl image ls`
pub async fn list(
    args: ImageLsArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let images: Vec<ImageView> = client.get("v1/images").all(args.all).send().await?;
    let width = term.width;
    term.show(args.json, &images, |images| {
        render_images(images, args.all, width)
    })
}

/// `devctl image show`
pub async fn show(
    args: ImageRefArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let image = fetch(client, &args.image, args.owner.as_ref()).await?;
    term.show(args.json, &image, render_image)
}

/// `devctl image rm`
pub async fn remove(
    args: ImageRefArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let image: ImageView = client
        .delete(&format!("v1/images/{}", args.image))
        .owner(args.owner.as_ref())
        .send()
        .await?;
    term.show(args.json, &image, |image| {
        format!("image {} removed ({})\n", image.reference, image.state)
    })
}

/// `GET /v1/images/{name:version | sha256:hex}[?owner=DN]`
pub async fn fetch(
    client: &Client,
    reference: &str,
    owner: Option<&Dn>,
) -> Result<ImageView, ClientError> {
    client
        .get(&format!("v1/images/{reference}"))
        .owner(owner)
        .send()
        .await
}

fn parse_lookup(value: &str) -> Result<String, String> {
    ImageLookup::parse(value)
        .map(|lookup| lookup.to_string())
        .map_err(|e| e.to_string())
}

fn short_digest(digest: Option<&str>) -> String {
    digest.map_or_else(
        || "-".to_owned(),
        |d| d.chars().take("sha256:".len() + 12).collect(),
    )
}

/// The table of `devctl image ls`; with `all`, each image's owner too. Wrapped to `width` (the
/// terminal's) when given.
pub fn render_images(images: &[ImageView], all: bool, width: Option<u16>) -> String {
    if images.is_empty() {
        return "no images: freeze a session with devctl freeze NAME --tag IMAGE:VERSION\n"
            .to_owned();
    }
    let mut headers = vec!["IMAGE", "STATE", "SIZE", "DIGEST", "SESSION", "CREATED"];
    if all {
        headers.push("OWNER");
    }
    let mut table = Table::new(&headers);
    table.keep_whole(&[0, 2, 3, 5]);
    for image in images {
        let mut state = image.state.to_string();
        if image.superseded_at.is_some() {
            state.push_str(" (tag moved)");
        }
        if let Some(progress) = image.progress.filter(|p| p.bytes_total > 0) {
            let percent =
                progress.bytes_done.min(progress.bytes_total) * 100 / progress.bytes_total;
            state.push_str(&format!(" {percent}%"));
        }
        let mut row = vec![
            image.reference.clone(),
            state,
            image.size.map_or_else(|| "-".to_owned(), format_bytes),
            short_digest(image.digest.as_deref()),
            image.session.to_string(),
            format_time(image.created_at),
        ];
        if all {
            row.push(image.owner.to_string());
        }
        table.row(row);
    }
    table.render(width, "")
}

/// The text of `devctl image show`.
pub fn render_image(image: &ImageView) -> String {
    let mut table = Table::bare();
    let mut field = |name: &str, value: String| table.field(name, value);
    field("image", image.reference.clone());
    field("state", image.state.to_string());
    field("reason", image.reason.clone());
    if let Some(progress) = image.progress {
        field(
            "progress",
            progress_line(progress.bytes_done, progress.bytes_total, None),
        );
    }
    field("owner", format!("{} ({})", image.owner, image.user_name));
    field(
        "digest",
        image.digest.clone().unwrap_or_else(|| "-".to_owned()),
    );
    field(
        "size",
        image.size.map_or_else(|| "-".to_owned(), format_bytes),
    );
    field(
        "SIF",
        image.sif_path.clone().unwrap_or_else(|| "-".to_owned()),
    );
    field(
        "Docker image",
        image.docker_image.as_ref().map_or_else(
            || "-".to_owned(),
            |d| format!("{d} (on node {})", image.node),
        ),
    );
    field(
        "session",
        format!("{} ({})", image.session, image.session_id),
    );
    field("base image", image.base_image.clone());
    field(
        "compression",
        format!("{:?}", image.compression).to_lowercase(),
    );
    field("created", format_time(image.created_at));
    if let Some(at) = image.finished_at {
        field("finished", format_time(at));
    }
    if let Some(at) = image.superseded_at {
        field(
            "tag moved",
            format!("{}: reach this one by its digest", format_time(at)),
        );
    }
    table.to_string()
}
