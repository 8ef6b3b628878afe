//! `devctl image ls|show|rm|share|unshare` (`GET /v1/images[?all=true|?shared=true]`,
//! `GET|DELETE /v1/images/{name:version | login/name:version | sha256:hex}[?owner=DN]`,
//! `POST /v1/images/{...}/share|unshare`), and how an image is described.
//!
//! A shared image is named `login/name:version` (its owner's login, then its tag) or by its
//! digest: `name:version` alone always means one's own image.

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
    #[arg(long, conflicts_with = "shared")]
    pub all: bool,
    /// The images their owners shared, which anyone may run as LOGIN/NAME:VERSION
    #[arg(long)]
    pub shared: bool,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ImageRefArgs {
    /// NAME:VERSION, LOGIN/NAME:VERSION (a shared image), or sha256:DIGEST (also reaches an
    /// image whose tag --force moved on)
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
    let mut request = client.get("v1/images").all(args.all);
    if args.shared {
        request = request.query(&[("shared", "true")]);
    }
    let images: Vec<ImageView> = request.send().await?;
    let width = term.width;
    let listing = match (args.all, args.shared) {
        (_, true) => Listing::Shared,
        (true, false) => Listing::All,
        (false, false) => Listing::Own,
    };
    term.show(args.json, &images, |images| {
        render_images(images, listing, width)
    })
}

/// `devctl image share` / `devctl image unshare`
pub async fn set_shared(
    args: ImageRefArgs,
    share: bool,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let action = if share { "share" } else { "unshare" };
    let image: ImageView = client
        .post(&format!("v1/images/{}/{action}", path_segment(&args.image)))
        .owner(args.owner.as_ref())
        .send()
        .await?;
    term.show(args.json, &image, |image| {
        let qualified = format!("{}/{}", image.user_name, image.reference);
        if image.shared {
            format!(
                "image {} is shared: anyone may run it as {qualified} or {}\n",
                image.reference,
                image.digest.as_deref().unwrap_or("its digest")
            )
        } else {
            format!(
                "image {} is private: only you may run it\n",
                image.reference
            )
        }
    })
}

/// An image name as one path segment: the `/` of `login/name:version` is sent as `%2F`.
pub fn path_segment(image: &str) -> String {
    image.replace('/', "%2F")
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
        .delete(&format!("v1/images/{}", path_segment(&args.image)))
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
        .get(&format!("v1/images/{}", path_segment(reference)))
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

/// Which images `devctl image ls` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// The caller's own.
    Own,
    /// Everybody's (admins), with each image's owner.
    All,
    /// The shared ones, named as others run them (`login/name:version`).
    Shared,
}

/// The table of `devctl image ls`. Wrapped to `width` (the terminal's) when given.
pub fn render_images(images: &[ImageView], listing: Listing, width: Option<u16>) -> String {
    if images.is_empty() {
        return match listing {
            Listing::Shared => "no shared images: an owner shares one with devctl image share \
                                NAME:VERSION\n"
                .to_owned(),
            _ => "no images: freeze a session with devctl freeze NAME --tag IMAGE:VERSION\n"
                .to_owned(),
        };
    }
    let all = listing == Listing::All;
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
        if image.shared && listing != Listing::Shared {
            state.push_str(" (shared)");
        }
        if let Some(progress) = image.progress.filter(|p| p.bytes_total > 0) {
            let percent =
                progress.bytes_done.min(progress.bytes_total) * 100 / progress.bytes_total;
            state.push_str(&format!(" {percent}%"));
        }
        let name = match listing {
            Listing::Shared => format!("{}/{}", image.user_name, image.reference),
            _ => image.reference.clone(),
        };
        let mut row = vec![
            name,
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
    if image.shared {
        field(
            "shared",
            format!(
                "anyone may run it as {}/{}",
                image.user_name, image.reference
            ),
        );
    }
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
    use chrono::{DateTime, Utc};
    use ongrid_core::image::{Compression, ImageProgress, ImageState};
    use ongrid_core::{NodeName, SessionId, SessionName, UserName};

    const DIGEST: &str = "sha256:98fbda8214f8eb5cf69a46a4e0318c561d172754e49e6d6e3ac8d585285e0229";

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    fn image(state: ImageState) -> ImageView {
        let ready = state == ImageState::Ready;
        ImageView {
            id: "1059acb6-44be-478d-a0f7-02810ec78a7d".parse().unwrap(),
            name: "mymodel".into(),
            version: "v1".into(),
            reference: "mymodel:v1".into(),
            owner: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
            user_name: UserName::parse("alice-smith").unwrap(),
            state,
            reason: "frozen on node1".into(),
            digest: ready.then(|| DIGEST.to_owned()),
            size: ready.then_some(83_058_688),
            sif_path: ready.then(|| "/images/sha256/98fb.sif".to_owned()),
            docker_image: ready.then(|| "ongrid/alice-smith/mymodel:v1".to_owned()),
            node: NodeName::parse("node1").unwrap(),
            session: SessionName::parse("train1").unwrap(),
            session_id: SessionId("6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f".parse().unwrap()),
            base_image: "ongrid/dev:latest".into(),
            compression: Compression::Zstd,
            created_at: at(0),
            finished_at: ready.then(|| at(68)),
            superseded_at: None,
            progress: None,
            shared: false,
        }
    }

    #[test]
    fn the_list_shows_progress_moved_tags_and_owners_for_all() {
        let building = ImageView {
            progress: Some(ImageProgress {
                bytes_done: 45,
                bytes_total: 100,
            }),
            ..image(ImageState::Building)
        };
        let moved = ImageView {
            superseded_at: Some(at(100)),
            ..image(ImageState::Ready)
        };
        assert_eq!(
            render_images(&[building, moved], Listing::Own, None),
            "IMAGE       STATE              SIZE      DIGEST               SESSION  CREATED\n\
             mymodel:v1  BUILDING 45%       -         -                    train1   2026-11-21 10:00:00Z\n\
             mymodel:v1  READY (tag moved)  79.2 MiB  sha256:98fbda8214f8  train1   2026-11-21 10:00:00Z\n"
        );
        let all = render_images(&[image(ImageState::Ready)], Listing::All, None);
        assert!(all.lines().next().unwrap().ends_with("  OWNER"), "{all}");
        assert!(
            render_images(&[], Listing::Own, None).starts_with("no images: freeze a session with")
        );
    }

    #[test]
    fn shared_images_are_listed_by_login_and_marked_in_ones_own_list() {
        let shared = ImageView {
            shared: true,
            ..image(ImageState::Ready)
        };
        assert_eq!(
            render_images(std::slice::from_ref(&shared), Listing::Shared, None),
            "IMAGE                   STATE  SIZE      DIGEST               SESSION  CREATED\n\
             alice-smith/mymodel:v1  READY  79.2 MiB  sha256:98fbda8214f8  train1   2026-11-21 10:00:00Z\n"
        );
        let own = render_images(std::slice::from_ref(&shared), Listing::Own, None);
        assert!(own.contains("\nmymodel:v1  READY (shared)  "), "{own}");
        assert!(render_image(&shared)
            .contains("\nshared:        anyone may run it as alice-smith/mymodel:v1\n"));
        assert!(render_images(&[], Listing::Shared, None).starts_with("no shared images"));
        assert_eq!(
            path_segment("alice-smith/mymodel:v1"),
            "alice-smith%2Fmymodel:v1"
        );
        assert_eq!(path_segment("mymodel:v1"), "mymodel:v1");
    }

    #[test]
    fn show_lists_every_field() {
        assert_eq!(
            render_image(&image(ImageState::Ready)),
            "image:         mymodel:v1\n\
             state:         READY\n\
             reason:        frozen on node1\n\
             owner:         /DC=org/DC=example/CN=Alice Smith (alice-smith)\n\
             digest:        sha256:98fbda8214f8eb5cf69a46a4e0318c561d172754e49e6d6e3ac8d585285e0229\n\
             size:          79.2 MiB\n\
             SIF:           /images/sha256/98fb.sif\n\
             Docker image:  ongrid/alice-smith/mymodel:v1 (on node node1)\n\
             session:       train1 (6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f)\n\
             base image:    ongrid/dev:latest\n\
             compression:   zstd\n\
             created:       2026-11-21 10:00:00Z\n\
             finished:      2026-11-21 10:01:08Z\n"
        );
        let building = ImageView {
            progress: Some(ImageProgress {
                bytes_done: 1 << 20,
                bytes_total: 0,
            }),
            ..image(ImageState::Building)
        };
        let text = render_image(&building);
        assert!(text.contains("\nprogress:      1.0 MiB read\n"), "{text}");
        assert!(text.contains("\nDocker image:  -\n"), "{text}");
    }
}
