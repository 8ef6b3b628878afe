//! `devctl freeze` and `devctl image ls|show|rm`: turn a session into a frozen image, follow
//! the freeze with a progress bar, and list, show and remove the results.
//!
//! `freeze` asks the manager (`POST /v1/images`), then polls the image once a second until it is
//! READY or FAILED. On a terminal the progress is one bar on stderr, redrawn in place (bytes of
//! the container's filesystem read, of the estimated total, and the rate); otherwise a plain
//! line every few seconds. The result (SIF path, digest, size, Docker image) goes to stdout, or
//! the image as JSON with `--json`.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use ongrid_core::image::{
    Compression, CreateImage, ImageLookup, ImageReference, ImageState, ImageView,
};
use ongrid_core::{Dn, SessionName};
use serde::Serialize;

use crate::client::Client;
use crate::commands::Terminal;
use crate::output::{format_bytes, format_time, Table};

/// How often `freeze` asks the manager about the image.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// How often `freeze` prints a progress line when stderr is not a terminal.
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Args)]
pub struct FreezeArgs {
    /// The session to freeze (it keeps running; HELD sessions can be frozen too)
    pub session: SessionName,
    /// Name and version of the image, like mymodel:v1
    #[arg(long, value_name = "NAME:VERSION")]
    pub tag: ImageReference,
    /// Move the tag if you already have an image of it (the old one stays reachable by its
    /// digest)
    #[arg(long)]
    pub force: bool,
    /// Compression of the squashfs inside the SIF: gzip mounts everywhere, zstd is smaller
    /// and faster (Apptainer ≥ 1.1)
    #[arg(long, default_value = "gzip", value_parser = parse_compression)]
    pub compression: Compression,
    /// Return at once, with the image BUILDING; follow it with devctl image show
    #[arg(long)]
    pub no_wait: bool,
    /// Print the image as JSON instead of text (no progress bar)
    #[arg(long)]
    pub json: bool,
}

fn parse_compression(value: &str) -> Result<Compression, String> {
    match value {
        "gzip" => Ok(Compression::Gzip),
        "zstd" => Ok(Compression::Zstd),
        other => Err(format!("compression {other:?} must be gzip or zstd")),
    }
}

fn parse_lookup(value: &str) -> Result<String, String> {
    ImageLookup::parse(value)
        .map(|lookup| lookup.to_string())
        .map_err(|e| e.to_string())
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// List your frozen images
    #[command(alias = "list")]
    Ls(ImageLsArgs),
    /// Show an image: state, SIF path, digest, size, Docker image, provenance
    Show(ImageRefArgs),
    /// Remove an image; its SIF file goes when no other image has the same digest
    #[command(alias = "remove")]
    Rm(ImageRefArgs),
}

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

fn print(term: &mut Terminal<'_>, text: &str) -> anyhow::Result<()> {
    term.out
        .write_all(text.as_bytes())
        .and_then(|()| term.out.flush())
        .context("writing to standard output")
}

fn print_json<T: Serialize>(term: &mut Terminal<'_>, value: &T) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value).context("encoding JSON")?;
    text.push('\n');
    print(term, &text)
}

/// `devctl freeze SESSION --tag NAME:VERSION`.
pub async fn freeze(
    args: FreezeArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let body = CreateImage {
        session: args.session.clone(),
        reference: args.tag.clone(),
        force: args.force,
        compression: args.compression,
    };
    let mut image = client.create_image(&body).await?;
    if args.no_wait {
        return if args.json {
            print_json(term, &image)
        } else {
            print(
                term,
                &format!(
                    "freezing session {} to {} on {} (BUILDING): follow it with `devctl image \
                     show {}`\n",
                    image.session, image.reference, image.node, image.reference
                ),
            )
        };
    }
    let bar = !args.json && std::io::stderr().is_terminal();
    let _ = writeln!(
        term.note,
        "freezing session {} to {} on {} (interrupting devctl does not stop the freeze)",
        image.session, image.reference, image.node
    );
    let mut meter = Meter::new(Instant::now());
    let mut last_plain: Option<Instant> = None;
    let reference = image.reference.clone();
    while image.state == ImageState::Building {
        tokio::time::sleep(POLL_INTERVAL).await;
        image = client.image(&reference, None).await?;
        let progress = image.progress.unwrap_or(ongrid_core::image::ImageProgress {
            bytes_done: 0,
            bytes_total: 0,
        });
        let now = Instant::now();
        let rate = meter.rate(progress.bytes_done, now);
        let line = progress_line(progress.bytes_done, progress.bytes_total, rate);
        if args.json {
            continue;
        }
        if bar {
            let _ = write!(term.note, "\r\x1b[2K{line}");
            let _ = term.note.flush();
        } else if last_plain.is_none_or(|at| now.duration_since(at) >= PLAIN_PROGRESS_EVERY) {
            let _ = writeln!(term.note, "{line}");
            last_plain = Some(now);
        }
    }
    if bar {
        let _ = writeln!(term.note);
    }
    match image.state {
        ImageState::Ready if args.json => print_json(term, &image),
        ImageState::Ready => print(term, &render_frozen(&image)),
        _ => anyhow::bail!(
            "freezing session {} to {} failed ({}): {}",
            image.session,
            image.reference,
            image.state,
            image.reason
        ),
    }
}

/// `devctl image ls|show|rm`.
pub async fn image(
    command: ImageCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        ImageCommand::Ls(ImageLsArgs { all, json }) => {
            let images = client.images(all).await?;
            if json {
                print_json(term, &images)
            } else {
                print(term, &render_images(&images, all))
            }
        }
        ImageCommand::Show(ImageRefArgs { image, owner, json }) => {
            let image = client.image(&image, owner.as_ref()).await?;
            if json {
                print_json(term, &image)
            } else {
                print(term, &render_image(&image))
            }
        }
        ImageCommand::Rm(ImageRefArgs { image, owner, json }) => {
            let image = client.remove_image(&image, owner.as_ref()).await?;
            if json {
                print_json(term, &image)
            } else {
                print(
                    term,
                    &format!("image {} removed ({})\n", image.reference, image.state),
                )
            }
        }
    }
}

/// The rate of progress since the first observation that moved.
#[derive(Debug)]
pub struct Meter {
    start: Option<(Instant, u64)>,
    created: Instant,
}

impl Meter {
    pub fn new(now: Instant) -> Self {
        Self {
            start: None,
            created: now,
        }
    }

    /// Bytes per second since the first sample, `None` until two samples a second apart.
    pub fn rate(&mut self, bytes_done: u64, now: Instant) -> Option<f64> {
        let (at, first) = *self.start.get_or_insert((self.created, 0));
        let elapsed = now.duration_since(at).as_secs_f64();
        (elapsed >= 1.0).then(|| bytes_done.saturating_sub(first) as f64 / elapsed)
    }
}

/// `[#########-----------]  45%  1.2 GiB / 2.6 GiB  85.0 MiB/s`; without a total (unknown),
/// only the bytes and the rate.
pub fn progress_line(bytes_done: u64, bytes_total: u64, rate: Option<f64>) -> String {
    const WIDTH: u64 = 30;
    let rate = rate.map_or_else(String::new, |r| {
        format!("  {}/s", format_bytes(r.max(0.0) as u64))
    });
    if bytes_total == 0 {
        return format!("{} read{rate}", format_bytes(bytes_done));
    }
    // The estimate can be short of the real size: never past 100 %.
    let done = bytes_done.min(bytes_total);
    let filled = done * WIDTH / bytes_total;
    let percent = done * 100 / bytes_total;
    format!(
        "[{}{}] {percent:>3}%  {} / {}{rate}",
        "#".repeat(filled as usize),
        "-".repeat((WIDTH - filled) as usize),
        format_bytes(bytes_done),
        format_bytes(bytes_total),
    )
}

/// What `freeze` prints when the image is READY.
pub fn render_frozen(image: &ImageView) -> String {
    format!(
        "image {} is READY\n  SIF:          {}\n  digest:       {}\n  size:         {}\n  \
         Docker image: {} (on node {})\n",
        image.reference,
        image.sif_path.as_deref().unwrap_or("-"),
        image.digest.as_deref().unwrap_or("-"),
        image.size.map_or_else(|| "-".to_owned(), format_bytes),
        image.docker_image.as_deref().unwrap_or("-"),
        image.node,
    )
}

fn short_digest(digest: Option<&str>) -> String {
    digest.map_or_else(
        || "-".to_owned(),
        |d| d.chars().take("sha256:".len() + 12).collect(),
    )
}

pub fn render_images(images: &[ImageView], all: bool) -> String {
    if images.is_empty() {
        return "no images: freeze a session with devctl freeze NAME --tag IMAGE:VERSION\n"
            .to_owned();
    }
    let mut headers = vec!["IMAGE", "STATE", "SIZE", "DIGEST", "SESSION", "CREATED"];
    if all {
        headers.push("OWNER");
    }
    let mut table = Table::new(&headers);
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
    table.to_string()
}

pub fn render_image(image: &ImageView) -> String {
    let mut table = Table::bare();
    let mut field = |name: &str, value: String| table.row(vec![format!("{name}:"), value]);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_shows_fraction_and_rate() {
        let line = progress_line(512 << 20, 1 << 30, Some((85 << 20) as f64));
        assert_eq!(
            line,
            "[###############---------------]  50%  512.0 MiB / 1.0 GiB  85.0 MiB/s"
        );
        // An estimate short of the truth stops at 100 %.
        assert!(progress_line(3 << 30, 1 << 30, None)
            .starts_with(&format!("[{}] 100%", "#".repeat(30))));
        assert_eq!(progress_line(2048, 0, None), "2.0 KiB read");
    }

    #[test]
    fn meter_waits_a_second_before_a_rate() {
        let t0 = Instant::now();
        let mut meter = Meter::new(t0);
        assert_eq!(meter.rate(100, t0 + Duration::from_millis(500)), None);
        let rate = meter.rate(4000, t0 + Duration::from_secs(2)).unwrap();
        assert!((rate - 2000.0).abs() < 1e-6, "{rate}");
    }
}
