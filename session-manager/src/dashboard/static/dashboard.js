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
  // The server sends only what differs from what the page holds (its digest, "have").
  var have = region.getAttribute("data-have") || "";
  var source = new EventSource(
    "/dashboard/events?view=" + encodeURIComponent(view) + "&have=" + encodeURIComponent(have)
  );
  source.addEventListener("update", function (event) {
    apply(event.data);
  });
})();
