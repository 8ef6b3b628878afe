// ongrid dashboard: keeps the page's live part current from the server's event stream, and asks
// before a removal. Every page works without it (forms post and the page reloads).
(function () {
  "use strict";
  document.addEventListener("submit", function (event) {
    var question = event.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) {
      event.preventDefault();
    }
  });
  var view = document.body.getAttribute("data-live");
  var region = document.getElementById("live");
  if (!view || !region || !window.EventSource) {
    return;
  }
  var pending = null;
  // Someone typing or tabbing inside the live part keeps it still until they leave it.
  function busy() {
    return region.contains(document.activeElement) && document.activeElement !== document.body;
  }
  function apply(html) {
    if (busy()) {
      pending = html;
      return;
    }
    region.innerHTML = html;
    pending = null;
  }
  region.addEventListener("focusout", function () {
    window.setTimeout(function () {
      if (pending !== null && !busy()) {
        apply(pending);
      }
    }, 0);
  });
  // The server sends only what differs from what the page holds (its digest, "have", which
  // each event's id carries).
  var have = region.getAttribute("data-have") || "";
  function listen() {
    var source = new EventSource(
      "/dashboard/events?view=" + encodeURIComponent(view) + "&have=" + encodeURIComponent(have)
    );
    source.addEventListener("update", function (event) {
      have = event.lastEventId || have;
      apply(event.data);
    });
    // The browser reconnects by itself after a dropped stream, but gives up for good on an
    // answer that is not a stream (a proxy's 502, a manager restarting): start again then.
    source.addEventListener("error", function () {
      if (source.readyState === EventSource.CLOSED) {
        window.setTimeout(listen, 3000);
      }
    });
  }
  listen();
})();
